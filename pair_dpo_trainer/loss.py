"""The DPO loss family as pure functions over per-pair log-probabilities.

Every variant takes a :class:`PairLogps` (``[n]`` float32 tensors, one entry per pair) and a :class:`LossParams`
and returns the per-pair losses ``[n]``. The trainer sums them and divides by the global pair count of the optimizer
step; nothing here knows about batches, ranks or accumulation.

Notation (Rafailov et al., 2023, "Direct Preference Optimization", arXiv:2305.18290)::

    h = (log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x))      # "logits" below

Example:
    >>> import torch
    >>> z = torch.zeros(2)
    >>> logps = PairLogps(z, z, z, z, chosen_token_counts=torch.ones(2), rejected_token_counts=torch.ones(2))
    >>> LOSS_FUNCTIONS["sigmoid"](logps, LossParams(beta=0.1)).tolist()   # ln 2 per pair at step 0
    [0.6931471824645996, 0.6931471824645996]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PairLogps:
    """Per-pair sequence log-probabilities of the policy and the reference.

    All fields are ``[n]`` float tensors on one device; ``*_token_counts`` are the numbers of completion tokens that
    were summed into the chosen / rejected log-probs (used by length-normalised terms such as the NLL of RPO).
    """

    policy_chosen_logps: torch.Tensor
    policy_rejected_logps: torch.Tensor
    ref_chosen_logps: torch.Tensor
    ref_rejected_logps: torch.Tensor
    chosen_token_counts: torch.Tensor
    rejected_token_counts: torch.Tensor

    def logits(self) -> torch.Tensor:
        """``h`` of the module docstring: the implicit reward difference before ``beta``. Shape ``[n]``."""
        chosen_logratios = self.policy_chosen_logps - self.ref_chosen_logps
        rejected_logratios = self.policy_rejected_logps - self.ref_rejected_logps
        return chosen_logratios - rejected_logratios

    def chosen_rewards(self, beta: float) -> torch.Tensor:
        """Implicit reward ``beta * log(pi/ref)`` of the chosen completions (DPO paper, Sec. 5). Shape ``[n]``."""
        return beta * (self.policy_chosen_logps - self.ref_chosen_logps)

    def rejected_rewards(self, beta: float) -> torch.Tensor:
        """Implicit reward of the rejected completions. Shape ``[n]``."""
        return beta * (self.policy_rejected_logps - self.ref_rejected_logps)


@dataclass(frozen=True)
class LossParams:
    """Hyper-parameters shared by the loss variants (validated by ``PairDPOConfig``)."""

    beta: float = 0.1
    label_smoothing: float = 0.0
    nll_weight: float = 1.0


LossFn = Callable[[PairLogps, LossParams], torch.Tensor]


def sigmoid_loss(logps: PairLogps, params: LossParams) -> torch.Tensor:
    """DPO (Rafailov et al. 2023, Eq. 7); with ``label_smoothing`` eps > 0 it is conservative DPO (cDPO,
    Mitchell 2023): the preference label is assumed flipped with probability eps.

    ``loss = -(1 - eps) * log sigmoid(beta h) - eps * log sigmoid(-beta h)``
    """
    scaled = params.beta * logps.logits()
    eps = params.label_smoothing
    return -(1.0 - eps) * F.logsigmoid(scaled) - eps * F.logsigmoid(-scaled)


def robust_loss(logps: PairLogps, params: LossParams) -> torch.Tensor:
    """Robust DPO (rDPO, Chowdhury et al. 2024, "Provably Robust DPO", Eq. 8): an unbiased loss under label noise
    rate eps = ``label_smoothing``.

    ``loss = [-(1 - eps) log sigmoid(beta h) + eps log sigmoid(-beta h)] / (1 - 2 eps)``
    """
    scaled = params.beta * logps.logits()
    eps = params.label_smoothing
    return (-(1.0 - eps) * F.logsigmoid(scaled) + eps * F.logsigmoid(-scaled)) / (1.0 - 2.0 * eps)


def ipo_loss(logps: PairLogps, params: LossParams) -> torch.Tensor:
    """IPO (Azar et al. 2023, "A General Theoretical Paradigm...", Eq. 17): squared distance of the log-ratio
    difference from ``1 / (2 beta)``, on summed sequence log-probs.

    ``loss = (h - 1 / (2 beta))^2``
    """
    return (logps.logits() - 1.0 / (2.0 * params.beta)) ** 2


def hinge_loss(logps: PairLogps, params: LossParams) -> torch.Tensor:
    """SLiC hinge loss (Zhao et al. 2023, "SLiC-HF", Eq. 1 with margin 1/beta scaled): ``relu(1 - beta h)``."""
    return torch.relu(1.0 - params.beta * logps.logits())


def sigmoid_nll_loss(logps: PairLogps, params: LossParams) -> torch.Tensor:
    """RPO (Pang et al. 2024, "Iterative Reasoning Preference Optimization", Eq. 3): DPO plus ``nll_weight`` times
    the length-normalised negative log-likelihood of the chosen completion.

    ``loss = sigmoid_loss + nll_weight * (-log pi(y_w|x) / |y_w|)``
    """
    nll = -logps.policy_chosen_logps / logps.chosen_token_counts.clamp(min=1)
    return sigmoid_loss(logps, params) + params.nll_weight * nll


LOSS_FUNCTIONS: dict[str, LossFn] = {
    "sigmoid": sigmoid_loss,
    "robust": robust_loss,
    "ipo": ipo_loss,
    "hinge": hinge_loss,
    "sigmoid_nll": sigmoid_nll_loss,
}

# Loss types for which ``label_smoothing`` has a meaning; the config rejects it elsewhere.
LABEL_SMOOTHING_LOSSES = frozenset({"sigmoid", "robust"})
