"""Objectives that need no reference model: SimPO, ORPO and the plain NLL (``sft``).

A run whose objectives are all listed here builds no reference at all (no forward, no memory), exactly like
``reference_free=True``; in a mixture with a reference objective the reference is built for the others.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pair_dpo_trainer.losses.base import NO_CONTEXT, LossParams, PairLogps, StepContext, smoothed_logistic


def simpo_loss(logps: PairLogps, params: LossParams, context: StepContext = NO_CONTEXT) -> torch.Tensor:
    """SimPO: the length-normalised policy log-likelihood is the reward; ``simpo_gamma`` is the target margin.

    ``eps > 0`` gives SimPO's conservative (cDPO) form, as in the SimPO authors' trainer and TRL's ``CPOTrainer``.
    """
    # Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward", arXiv:2405.14734,
    # Eq. 6: -log sigmoid(b / |y_w| log pi(y_w|x) - b / |y_l| log pi(y_l|x) - gamma)
    margin = params.beta * (logps.chosen_mean_logps() - logps.rejected_mean_logps()) - params.simpo_gamma
    return smoothed_logistic(margin, params.label_smoothing)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x <= 0``, accurate on both sides of ``-log 2`` (Maechler 2012)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_loss(logps: PairLogps, params: LossParams, context: StepContext = NO_CONTEXT) -> torch.Tensor:
    """ORPO as TRL 1.16's ``ORPOTrainer`` computes it: the chosen NLL plus ``beta`` (the paper's lambda) times the
    log odds-ratio loss.

    The NLL is TRL's: one token mean over every token of the chosen sequences after the first (prompt and
    completion), here over the optimizer step (``context.chosen_sequence_tokens_per_pair``; without a context, this
    micro-batch's own ratio, TRL's per-micro-batch mean); the paper's Eq. 2 averages the completion only.

    Raises:
        ValueError: The log-probs carry no prompt sums (the policy pass did not score the chosen prompts).
    """
    # Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference Model", arXiv:2403.07691.
    # Eq. 4: odds(y|x) = P(y|x) / (1 - P(y|x)) with P = exp(log pi(y|x) / |y|);
    # Eq. 7: L_OR = -log sigmoid(log odds(y_w|x) - log odds(y_l|x)); Eq. 6: L_ORPO = L_SFT + lambda L_OR, with
    # L_SFT as TRL's ORPOTrainer takes it: -sum_{t >= 1} log pi(s_t | s_<t) / #tokens over the chosen s = x + y_w.
    if logps.chosen_prompt_logps is None or logps.chosen_prompt_token_counts is None:
        raise ValueError("orpo needs the chosen prompts' log-probs (PackedPairCollator(score_chosen_prompts=True))")
    chosen, rejected = logps.chosen_mean_logps(), logps.rejected_mean_logps()
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    per_pair = context.chosen_sequence_tokens_per_pair
    if per_pair is None:  # float64: a float32 ratio of token counts would round (the loss keeps its own dtype)
        counts = (logps.chosen_token_counts + logps.chosen_prompt_token_counts).to(torch.float64)
        per_pair = counts.sum() / counts.shape[0]
    nll = (logps.chosen_nll() - logps.chosen_prompt_logps) / per_pair.clamp(min=1e-12)
    return nll - params.beta * F.logsigmoid(log_odds)


def sft_loss(logps: PairLogps, params: LossParams, context: StepContext = NO_CONTEXT) -> torch.Tensor:
    """The NLL of the chosen completions, as a token mean over the optimizer step (TRL's ``sft``, MPO's
    generation term).

    Per pair ``-log pi(y_w|x) / c`` with ``c`` the step's chosen tokens per pair (``context.chosen_tokens_per_pair``),
    so that the trainer's mean over the step's pairs is ``-sum log pi / (chosen tokens of the step)``; without a
    context, ``c`` is this micro-batch's own ratio (TRL's per-micro-batch token mean).
    """
    # Negative log-likelihood (maximum likelihood on the chosen completions), the generation loss L_g of MPO
    # (Wang et al. 2024, "Enhancing the Reasoning Ability of Multimodal LLMs via Mixed Preference Optimization",
    # arXiv:2411.10442, Sec. 3, L = w_p L_p + w_q L_q + w_g L_g): -sum_t log pi(y_w,t | x, y_w,<t) / #chosen tokens
    per_pair = context.chosen_tokens_per_pair
    if per_pair is None:  # float64: a float32 ratio of token counts would round (the loss keeps its own dtype)
        counts = logps.chosen_token_counts.to(torch.float64)
        per_pair = counts.sum() / counts.shape[0]
    return logps.chosen_nll() / per_pair.clamp(min=1e-12)
