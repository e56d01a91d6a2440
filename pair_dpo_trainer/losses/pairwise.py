"""Objectives on the policy/reference log-ratios of one pair: each a pure function ``(logps, params, context)`` ->
per-pair losses ``[n]``, with its paper, arXiv id and equation at the line of maths.

``u_w``, ``u_l``, ``h`` and ``delta_score`` are defined in :mod:`pair_dpo_trainer.losses.base`; ``b`` is ``beta``
and ``eps`` is ``label_smoothing``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pair_dpo_trainer.losses.base import (
    NO_CONTEXT,
    LossParams,
    PairLogps,
    StepContext,
    delta_score,
    length_normalized_delta,
    smoothed_logistic,
)


def sigmoid_loss(logps: PairLogps, params: LossParams, context: StepContext = NO_CONTEXT) -> torch.Tensor:
    """DPO; with ``eps > 0`` conservative DPO (cDPO: the preference label is flipped with probability eps)."""
    # Rafailov et al. 2023, arXiv:2305.18290, Eq. 7; cDPO: Mitchell 2023, "A note on DPO with noisy preferences".
    return smoothed_logistic(params.beta * delta_score(logps, params), params.label_smoothing)


def robust_loss(logps: PairLogps, params: LossParams, context: StepContext = NO_CONTEXT) -> torch.Tensor:
    """Robust DPO (rDPO): an unbiased estimate of the clean DPO loss under label-noise rate eps."""
    # Chowdhury et al. 2024, "Provably Robust DPO", arXiv:2403.00409, Eq. 8:
    # [-(1 - eps) log sigmoid(b h) + eps log sigmoid(-b h)] / (1 - 2 eps)
    scaled = params.beta * delta_score(logps, params)
    eps = params.label_smoothing
    return (-(1.0 - eps) * F.logsigmoid(scaled) + eps * F.logsigmoid(-scaled)) / (1.0 - 2.0 * eps)


def ipo_loss(logps: PairLogps, params: LossParams, context: StepContext = NO_CONTEXT) -> torch.Tensor:
    """IPO on per-token (length-normalised) log-ratios: TRL 1.16's ``ipo`` (per TRL's comment confirmed with the IPO
    authors; the paper's reported results use this form). The summed form of Eq. 17 is :func:`ipo_sum_loss`."""
    # Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human Preferences",
    # arXiv:2310.12036, Eq. 17 with u_w / |y_w| and u_l / |y_l| in place of u_w and u_l:
    # (u_w / |y_w| - u_l / |y_l| - 1 / (2 tau))^2
    return (length_normalized_delta(logps, params) - 1.0 / (2.0 * params.beta)) ** 2


def ipo_sum_loss(logps: PairLogps, params: LossParams, context: StepContext = NO_CONTEXT) -> torch.Tensor:
    """IPO on summed sequence log-ratios, as Eq. 17 is written (beta is the paper's tau): the target margin
    ``1 / (2 beta)`` is in nats per sequence, so the loss grows with completion length. Not TRL's ``ipo``."""
    # Azar et al. 2023, arXiv:2310.12036, Eq. 17: (h - 1 / (2 tau))^2
    return (delta_score(logps, params) - 1.0 / (2.0 * params.beta)) ** 2


def hinge_loss(logps: PairLogps, params: LossParams, context: StepContext = NO_CONTEXT) -> torch.Tensor:
    """SLiC hinge (calibration) loss on the log-ratio difference, margin 1 after scaling by beta."""
    # Zhao et al. 2023, "SLiC-HF", arXiv:2305.10425, Eq. 1 (max(0, delta - log P(y+) + log P(y-)), delta = 1/b,
    # with log-ratios to the reference as in DPO Sec. 6): relu(1 - b h)
    return torch.relu(1.0 - params.beta * delta_score(logps, params))


def exo_pair_loss(logps: PairLogps, params: LossParams, context: StepContext = NO_CONTEXT) -> torch.Tensor:
    """EXO-pref: KL(p_theta || p_rh) over {chosen, rejected}, p_rh = (1 - eps, eps) (eps > 0 required)."""
    # Ji et al. 2024, "Towards Efficient Exact Optimization of Language Model Alignment", arXiv:2402.00856, Eq. 16
    # with K = 2: q_w = sigmoid(b h), q_l = sigmoid(-b h);
    # loss = q_w (log q_w - log(1 - eps)) + q_l (log q_l - log eps)
    scaled = params.beta * delta_score(logps, params)
    eps = torch.tensor(params.label_smoothing, dtype=scaled.dtype, device=scaled.device)
    chosen = torch.sigmoid(scaled) * (F.logsigmoid(scaled) - torch.log1p(-eps))
    rejected = torch.sigmoid(-scaled) * (F.logsigmoid(-scaled) - torch.log(eps))
    return chosen + rejected


def nca_pair_loss(logps: PairLogps, params: LossParams, context: StepContext = NO_CONTEXT) -> torch.Tensor:
    """NCA (pairwise, K = 2): raises the chosen reward itself, not only the margin."""
    # Chen et al. 2024, "Noise Contrastive Alignment of Language Models with Explicit Rewards", arXiv:2402.05369,
    # Sec. 3.2 (NCA loss, K = 2, r = b u): -log sigmoid(r_w) - 1/2 log sigmoid(-r_w) - 1/2 log sigmoid(-r_l)
    chosen = params.beta * logps.chosen_logratios()
    rejected = params.beta * logps.rejected_logratios()
    return -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)


def bco_pair_loss(logps: PairLogps, params: LossParams, context: StepContext = NO_CONTEXT) -> torch.Tensor:
    """BCO on pairs without the reward shift (delta = 0): chosen completions classified as good, rejected as bad.
    TRL 1.16's ``bco_pair``; the paper's shifted form is :func:`bco_pair_shift_loss`."""
    # Jung et al. 2024, "Binary Classifier Optimization for Large Language Model Alignment", arXiv:2404.04656,
    # Sec. 3 (BCE, r = b u) with delta = 0: -log sigmoid(r_w) - log sigmoid(-r_l)
    chosen = params.beta * logps.chosen_logratios()
    rejected = params.beta * logps.rejected_logratios()
    return -F.logsigmoid(chosen) - F.logsigmoid(-rejected)


def bco_pair_shift_loss(logps: PairLogps, params: LossParams, context: StepContext = NO_CONTEXT) -> torch.Tensor:
    """BCO on pairs around the reward shift delta (the running mean implicit reward of all previous optimizer steps,
    ``context.bco_delta``), as the paper defines it."""
    # Jung et al. 2024, arXiv:2404.04656, Sec. 3 (BCE with reward shift delta, r = b u):
    # -log sigmoid(r_w - delta) - log sigmoid(-(r_l - delta))
    delta = context.bco_delta
    chosen = params.beta * logps.chosen_logratios() - delta
    rejected = params.beta * logps.rejected_logratios() - delta
    return -F.logsigmoid(chosen) - F.logsigmoid(-rejected)


def sppo_hard_loss(logps: PairLogps, params: LossParams, context: StepContext = NO_CONTEXT) -> torch.Tensor:
    """SPPO with hard win probabilities (P = 1 for the chosen, 0 for the rejected completion)."""
    # Wu et al. 2024, "Self-Play Preference Optimization for Language Model Alignment", arXiv:2405.00675, Eq. 4.7
    # (Algorithm 1) with P(y_w > pi) = 1, P(y_l > pi) = 0: (u_w - 1/(2b))^2 + (u_l + 1/(2b))^2
    half = 0.5 / params.beta
    return (logps.chosen_logratios() - half) ** 2 + (logps.rejected_logratios() + half) ** 2


def apo_zero_loss(logps: PairLogps, params: LossParams, context: StepContext = NO_CONTEXT) -> torch.Tensor:
    """APO-zero: raise the chosen and lower the rejected likelihood (chosen better than the model's own outputs)."""
    # D'Oosterlinck et al. 2024, "Anchored Preference Optimization and Contrastive Revisions", arXiv:2408.06266,
    # Eq. 7: (1 - sigmoid(b u_w)) + sigmoid(b u_l)
    return (1.0 - torch.sigmoid(params.beta * logps.chosen_logratios())) + torch.sigmoid(
        params.beta * logps.rejected_logratios()
    )


def apo_down_loss(logps: PairLogps, params: LossParams, context: StepContext = NO_CONTEXT) -> torch.Tensor:
    """APO-down: lower both likelihoods, the rejected one more (chosen worse than the model's own outputs)."""
    # D'Oosterlinck et al. 2024, arXiv:2408.06266, Eq. 8: sigmoid(b u_w) + (1 - sigmoid(b (u_w - u_l)))
    return torch.sigmoid(params.beta * logps.chosen_logratios()) + (
        1.0 - torch.sigmoid(params.beta * logps.logratio_margins())
    )


def discopop_loss(logps: PairLogps, params: LossParams, context: StepContext = NO_CONTEXT) -> torch.Tensor:
    """DiscoPOP (log-ratio modulated loss): a sigmoid-gated blend of the logistic and the exponential loss."""
    # Lu et al. 2024, "Discovering Preference Optimization Algorithms with and for Large Language Models",
    # arXiv:2406.08414, Eq. 5 (tau = discopop_tau): z = b h, m = sigmoid(z / tau);
    # loss = (1 - m) (-log sigmoid(z)) + m exp(-z)
    scaled = params.beta * delta_score(logps, params)
    modulation = torch.sigmoid(scaled / params.discopop_tau)
    return (1.0 - modulation) * -F.logsigmoid(scaled) + modulation * torch.exp(-scaled)


def sigmoid_norm_loss(logps: PairLogps, params: LossParams, context: StepContext = NO_CONTEXT) -> torch.Tensor:
    """Length-normalised DPO: the DPO loss on per-token log-ratios (TRL's ``sigmoid_norm``)."""
    # Lambert et al. 2024, "Tulu 3: Pushing Frontiers in Open Language Model Post-Training", arXiv:2411.15124,
    # length-normalized DPO objective (Sec. 5):
    # -log sigmoid(b (u_w / |y_w| - u_l / |y_l|))
    return -F.logsigmoid(params.beta * length_normalized_delta(logps, params))


def sigmoid_nll_loss(logps: PairLogps, params: LossParams, context: StepContext = NO_CONTEXT) -> torch.Tensor:
    """RPO: DPO plus ``nll_weight`` times the length-normalised NLL of the chosen completion."""
    # Pang et al. 2024, "Iterative Reasoning Preference Optimization", arXiv:2404.19733, Eq. 3:
    # sigmoid_loss + nll_weight * (-log pi(y_w|x) / |y_w|)
    nll = logps.chosen_nll() / logps.chosen_token_counts.clamp(min=1)
    return sigmoid_loss(logps, params) + params.nll_weight * nll
