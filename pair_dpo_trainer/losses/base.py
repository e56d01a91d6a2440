"""What every preference objective reads: per-pair log-probs, hyper-parameters and the step context.

Notation (Rafailov et al. 2023, "Direct Preference Optimization", arXiv:2305.18290)::

    chosen log-ratio    u_w = log pi(y_w|x) - log ref(y_w|x)
    rejected log-ratio  u_l = log pi(y_l|x) - log ref(y_l|x)
    h = u_w - u_l                                   # PairLogps.logratio_margins()

Objectives built on the chosen-rejected reward difference use ``delta_score`` instead of ``h``: the same difference
after the f-divergence transform of f-DPO (``f_divergence_type``; ``reverse_kl``, the default, is the identity).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PairLogps:
    """Per-pair sequence log-probabilities of the policy and the reference (``[n]`` float tensors on one device).

    Attributes:
        policy_chosen_logps / policy_rejected_logps: Summed completion-token log-probs of the policy (LD-DPO
            weighted when ``ld_alpha`` is set, see
            :func:`pair_dpo_trainer.losses.length_weights.length_desensitized_weights`).
        ref_chosen_logps / ref_rejected_logps: The same for the reference (0 when there is none).
        chosen_token_counts / rejected_token_counts: Scored completion tokens per sequence.
        policy_chosen_nll_logps: The plain (never LD-weighted) summed chosen log-probs, for NLL terms; None means
            ``policy_chosen_logps`` (no ``ld_alpha``).
        chosen_wpo_logps / rejected_wpo_logps: Detached ``sum_t (log p_t - log sum_v p_v^2)`` per sequence, the
            WPO weight's exponent before length normalisation (``use_weighting``); None otherwise.
        chosen_prompt_logps: Summed (plain) log-probs of the chosen sequence's prompt tokens after the first, when the
            policy pass scored them (ORPO's NLL over prompt and completion); None otherwise.
        chosen_prompt_token_counts: How many prompt tokens ``chosen_prompt_logps`` sums; None otherwise.
    """

    policy_chosen_logps: torch.Tensor
    policy_rejected_logps: torch.Tensor
    ref_chosen_logps: torch.Tensor
    ref_rejected_logps: torch.Tensor
    chosen_token_counts: torch.Tensor
    rejected_token_counts: torch.Tensor
    policy_chosen_nll_logps: torch.Tensor | None = None
    chosen_wpo_logps: torch.Tensor | None = None
    rejected_wpo_logps: torch.Tensor | None = None
    chosen_prompt_logps: torch.Tensor | None = None
    chosen_prompt_token_counts: torch.Tensor | None = None

    def chosen_logratios(self) -> torch.Tensor:
        """``u_w``. Shape ``[n]``."""
        return self.policy_chosen_logps - self.ref_chosen_logps

    def rejected_logratios(self) -> torch.Tensor:
        """``u_l``. Shape ``[n]``."""
        return self.policy_rejected_logps - self.ref_rejected_logps

    def logratio_margins(self) -> torch.Tensor:
        """``h = u_w - u_l``: the implicit reward difference before ``beta``. Shape ``[n]``."""
        return self.chosen_logratios() - self.rejected_logratios()

    def chosen_rewards(self, beta: float) -> torch.Tensor:
        """Implicit reward ``beta * u_w`` of the chosen completions (DPO paper, Sec. 5). Shape ``[n]``."""
        return beta * self.chosen_logratios()

    def rejected_rewards(self, beta: float) -> torch.Tensor:
        """Implicit reward ``beta * u_l`` of the rejected completions. Shape ``[n]``."""
        return beta * self.rejected_logratios()

    def chosen_nll(self) -> torch.Tensor:
        """Summed negative log-likelihood of the chosen completion (never LD-weighted). Shape ``[n]``."""
        logps = self.policy_chosen_logps if self.policy_chosen_nll_logps is None else self.policy_chosen_nll_logps
        return -logps

    def chosen_mean_logps(self) -> torch.Tensor:
        """``log pi(y_w|x) / |y_w|``, the length-normalised chosen log-prob (SimPO, ORPO). Shape ``[n]``."""
        return self.policy_chosen_logps / self.chosen_token_counts.clamp(min=1)

    def rejected_mean_logps(self) -> torch.Tensor:
        """``log pi(y_l|x) / |y_l|``. Shape ``[n]``."""
        return self.policy_rejected_logps / self.rejected_token_counts.clamp(min=1)


@dataclass(frozen=True)
class LossParams:
    """Hyper-parameters of the objectives (validated by ``PairDPOConfig.option_problems``; TRL 1.16's names)."""

    beta: float = 0.1
    label_smoothing: float = 0.0
    nll_weight: float = 1.0
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    discopop_tau: float = 0.05
    simpo_gamma: float = 0.5


@dataclass(frozen=True)
class AotMatch:
    """The sort-matched partners of each pair for AOT, from the whole optimizer step (``[n]`` each, detached).

    Attributes:
        ref_margins: ``aot``: the reference margin ``log ref(y_w) - log ref(y_l)`` of the same rank (in the step's
            sorted reference margins) as this pair's policy margin has in the step's sorted policy margins.
        rejected_logratios: ``aot_unpaired``: the rejected log-ratio of the same rank as this pair's chosen
            log-ratio.
        chosen_logratios: ``aot_unpaired``: the chosen log-ratio of the same rank as this pair's rejected log-ratio.
    """

    ref_margins: torch.Tensor
    rejected_logratios: torch.Tensor
    chosen_logratios: torch.Tensor


@dataclass(frozen=True)
class StepContext:
    """Quantities of the whole optimizer step (all ranks, all micro-batches) that step-level objectives need.

    The trainer builds one per micro-batch before the step starts (``training.step_context``); without one
    (evaluation, or a
    direct call) each objective falls back to the micro-batch alone, as TRL does.

    Attributes:
        bco_delta: BCO's reward shift, the running mean implicit reward of all previous steps (scalar).
        chosen_tokens_per_pair: Chosen completion tokens of the step divided by its pairs (scalar), so that ``sft``
            is the token mean of the step's chosen NLL; None: this micro-batch's own ratio.
        chosen_sequence_tokens_per_pair: Chosen prompt (after its first token) plus completion tokens of the step
            divided by its pairs (scalar), for ORPO's NLL; None: this micro-batch's own ratio.
        aot: The step's sort-matched partners for ``aot`` / ``aot_unpaired``; None: sort within the micro-batch.
    """

    bco_delta: torch.Tensor | float = 0.0
    chosen_tokens_per_pair: torch.Tensor | None = None
    aot: AotMatch | None = None
    chosen_sequence_tokens_per_pair: torch.Tensor | None = None


NO_CONTEXT = StepContext()

LossFn = Callable[[PairLogps, LossParams, StepContext], torch.Tensor]


def smoothed_logistic(z: torch.Tensor, eps: float) -> torch.Tensor:
    """``-(1 - eps) log sigmoid(z) - eps log sigmoid(-z)``: the logistic loss of a Bradley-Terry preference whose
    label is flipped with probability ``eps`` (conservative DPO, Mitchell 2023, "A note on DPO with noisy
    preferences"); ``eps = 0`` is the plain logistic loss."""
    return -(1.0 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)


# f-DPO (Wang et al. 2023, "Beyond Reverse KL: Generalizing Direct Preference Optimization with Diverse Divergence
# Constraints", arXiv:2309.16240, Theorem 1 and Table 1): the DPO reward beta * log(pi/ref) becomes beta * f'(pi/ref)
# with f' of the chosen divergence, applied to u = log(pi/ref). Constants of f' cancel in the chosen-rejected
# difference (reverse KL: f'(t) = log t + 1 -> log t).
_ALPHA_CLAMP = {torch.float16: 11.0}
"""Largest exponent kept in the alpha-divergence score, as TRL 1.16 (80 for float32/bfloat16, 11 for float16)."""


def _alpha_divergence(logratios: torch.Tensor, coef: float) -> torch.Tensor:
    """``(t^(coef-1) - 1) / (coef - 1)`` with ``t = exp(u)`` (TRL's parameterisation: the paper's alpha is
    ``1 - coef``, f'(t) = (1 - t^-alpha) / alpha); the limit ``coef -> 1`` is ``u`` (reverse KL)."""
    if abs(coef - 1.0) < 1e-6:
        return logratios
    exponent = ((coef - 1.0) * logratios).clamp(max=_ALPHA_CLAMP.get(logratios.dtype, 80.0))
    return torch.expm1(exponent) / (coef - 1.0)


F_DIVERGENCES: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "reverse_kl": lambda u, _coef: u,  # f'(t) = log t (+1)
    "forward_kl": lambda u, _coef: -torch.expm1(-u),  # f'(t) = 1 - 1/t
    "js_divergence": lambda u, _coef: math.log(2.0) + F.logsigmoid(u),  # f'(t) = log(2t / (1 + t))
    "alpha_divergence": _alpha_divergence,
}


def divergence_scores(logps: PairLogps, params: LossParams) -> tuple[torch.Tensor, torch.Tensor]:
    """``(f'(u_w), f'(u_l))`` for ``params.f_divergence_type`` (f-DPO Theorem 1). Shapes ``[n]``."""
    score = F_DIVERGENCES[params.f_divergence_type]
    coef = params.f_alpha_divergence_coef
    return score(logps.chosen_logratios(), coef), score(logps.rejected_logratios(), coef)


def delta_score(logps: PairLogps, params: LossParams) -> torch.Tensor:
    """``f'(u_w) - f'(u_l)``; equals :meth:`PairLogps.logratio_margins` under the default ``reverse_kl``.
    Shape ``[n]``."""
    chosen, rejected = divergence_scores(logps, params)
    return chosen - rejected


def length_normalized_delta(logps: PairLogps, params: LossParams) -> torch.Tensor:
    """``f'(u_w) / |y_w| - f'(u_l) / |y_l|``: the per-token reward difference (TRL's ``ipo`` and ``sigmoid_norm``)."""
    chosen, rejected = divergence_scores(logps, params)
    return chosen / logps.chosen_token_counts.clamp(min=1) - rejected / logps.rejected_token_counts.clamp(min=1)
