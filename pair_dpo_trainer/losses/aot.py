"""AOT (distributional alignment via optimal transport): objectives that sort within a batch.

"Batch" here is the optimizer step's global pairs (every rank, every micro-batch), so the gradient does not depend
on the data-parallel / gradient-accumulation layout: before the step the trainer runs one gradient-free pass over
the step's micro-batches, gathers the margins of all ranks and gives each pair its sort-matched partner
(:class:`~pair_dpo_trainer.losses.base.AotMatch`, built by :func:`sort_matched`). The sorted-sum loss
``sum_i f(x_(i) - y_(i))`` equals ``sum_j f(x_j - y_(rank(x_j)))``, and its gradient with respect to ``x_j`` is
``f'(x_j - y_(rank(x_j)))``: per pair, with the partner held fixed. Without a step context (evaluation) the batch is
the micro-batch, which is also TRL 1.16's batch (its per-device micro-batch).
"""

from __future__ import annotations

import torch

from pair_dpo_trainer.losses.base import NO_CONTEXT, LossParams, PairLogps, StepContext, smoothed_logistic


def sort_matched(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``sorted(y)[rank(x_j)]`` for every ``j``: the element of ``y`` at the rank ``x_j`` has in ``x`` (stable
    ranks, ties in index order). Shapes ``[m]``; no gradient flows (detached)."""
    x, y = x.detach(), y.detach()
    order = torch.sort(x, stable=True).indices
    ranks = torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0], device=order.device))
    return torch.sort(y, stable=True).values[ranks]


def aot_loss(logps: PairLogps, params: LossParams, context: StepContext = NO_CONTEXT) -> torch.Tensor:
    """AOT (paired): the logistic loss between sorted policy margins and sorted reference margins."""
    # Melnyk et al. 2024, "Distributional Preference Alignment of LLMs via Optimal Transport", arXiv:2406.05882,
    # Sec. 3 (paired AOT, logistic loss on the sorted margins, first-order stochastic dominance):
    # sum_i [-(1 - eps) log sigmoid(b d_i) - eps log sigmoid(-b d_i)],
    # d_i = sort(log pi(y_w) - log pi(y_l))_i - sort(log ref(y_w) - log ref(y_l))_i
    margins = logps.policy_chosen_logps - logps.policy_rejected_logps
    ref_margins = logps.ref_chosen_logps - logps.ref_rejected_logps
    partner = context.aot.ref_margins if context.aot is not None else sort_matched(margins, ref_margins)
    return smoothed_logistic(params.beta * (margins - partner), params.label_smoothing)


def aot_unpaired_loss(logps: PairLogps, params: LossParams, context: StepContext = NO_CONTEXT) -> torch.Tensor:
    """AOT (unpaired): the logistic loss between the sorted chosen and the sorted rejected log-ratios.

    Both sides carry gradient, so each pair's value is ``f(u_w - partner)`` and a zero-valued term adds the
    rejected side's gradient ``f(partner' - u_l)`` (value subtracted, gradient kept).
    """
    # Melnyk et al. 2024, arXiv:2406.05882, Sec. 3 (unpaired AOT): sum_i f(sort(u_w)_i - sort(u_l)_i),
    # f(d) = -(1 - eps) log sigmoid(b d) - eps log sigmoid(-b d)
    chosen, rejected = logps.chosen_logratios(), logps.rejected_logratios()
    if context.aot is not None:
        rejected_partner, chosen_partner = context.aot.rejected_logratios, context.aot.chosen_logratios
    else:
        rejected_partner, chosen_partner = sort_matched(chosen, rejected), sort_matched(rejected, chosen)
    eps = params.label_smoothing
    value = smoothed_logistic(params.beta * (chosen - rejected_partner), eps)
    rejected_side = smoothed_logistic(params.beta * (chosen_partner - rejected), eps)
    return value + (rejected_side - rejected_side.detach())
