"""The run's objective: one or several weighted components (``loss_type`` + ``loss_weights``), optionally WPO-weighted.

``loss = sum_k loss_weights[k] * w * loss_k`` per pair, with ``w = 1`` or the WPO weight of the pair. The trainer
sums the per-pair totals and divides by the global pair count of the step (exactly TRL's
``sum_k weight_k * mean(loss_k)`` on a single micro-batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pair_dpo_trainer.losses.base import NO_CONTEXT, LossParams, PairLogps, StepContext
from pair_dpo_trainer.losses.registry import OBJECTIVES


@dataclass(frozen=True)
class ObjectiveOutput:
    """Per-pair losses of one micro-batch.

    Attributes:
        losses: ``[n]`` the weighted total per pair.
        components: Objective name -> ``[n]`` its per-pair loss after the WPO weight, before its ``loss_weights``
            factor (logged as ``loss/<name>`` for mixtures).
    """

    losses: torch.Tensor
    components: dict[str, torch.Tensor]


def wpo_weights(logps: PairLogps) -> torch.Tensor:
    """WPO's per-pair weight ``w(y_w) * w(y_l)``, ``w(y) = exp(mean_t [log p_t - log sum_v p_v^2])`` (detached).

    Zhou et al. 2024, "WPO: Enhancing RLHF with Weighted Preference Optimization", arXiv:2406.11827, Eq. 2 with the
    aligned (sampling-distribution normalised) token probability of Sec. 3.2, as TRL 1.16 implements it. Shape
    ``[n]``.

    Raises:
        ValueError: The log-probs carry no WPO sums (the policy pass ran without ``use_weighting``).
    """
    if logps.chosen_wpo_logps is None or logps.rejected_wpo_logps is None:
        raise ValueError("use_weighting needs the policy's per-token WPO sums (packed_policy_logps(wpo=True))")
    chosen = logps.chosen_wpo_logps / logps.chosen_token_counts.clamp(min=1)
    rejected = logps.rejected_wpo_logps / logps.rejected_token_counts.clamp(min=1)
    return torch.exp(chosen + rejected).detach()


class Objective:
    """A weighted sum of named objectives.

    Args:
        loss_types: Objective names (keys of :data:`~pair_dpo_trainer.losses.registry.OBJECTIVES`).
        loss_weights: One weight per name (None: all 1.0, TRL's default).
        params: The hyper-parameters.
        use_weighting: Multiply every component by the WPO weight of the pair.

    Example:
        >>> import torch
        >>> z = torch.zeros(2)
        >>> logps = PairLogps(z, z, z, z, torch.ones(2), torch.ones(2))
        >>> out = Objective(["sigmoid", "sft"], [0.5, 1.0], LossParams())(logps)
        >>> [round(v, 4) for v in out.losses.tolist()], sorted(out.components)
        ([0.3466, 0.3466], ['sft', 'sigmoid'])
    """

    def __init__(
        self,
        loss_types: Sequence[str],
        loss_weights: Sequence[float] | None,
        params: LossParams,
        *,
        use_weighting: bool = False,
    ) -> None:
        weights = [1.0] * len(loss_types) if loss_weights is None else [float(w) for w in loss_weights]
        if len(weights) != len(loss_types):
            raise ValueError(f"{len(weights)} loss_weights for {len(loss_types)} loss types")
        pairs = zip(loss_types, weights, strict=True)
        self.terms = tuple((name, OBJECTIVES[name].fn, weight) for name, weight in pairs)
        self.params = params
        self.use_weighting = use_weighting

    @property
    def names(self) -> tuple[str, ...]:
        """The component names, in configuration order."""
        return tuple(name for name, _, _ in self.terms)

    def needs(self, attribute: str) -> bool:
        """True when some component's :class:`~pair_dpo_trainer.losses.registry.ObjectiveSpec` sets ``attribute``."""
        return any(getattr(OBJECTIVES[name], attribute) for name in self.names)

    def __call__(self, logps: PairLogps, context: StepContext = NO_CONTEXT) -> ObjectiveOutput:
        """Per-pair total and component losses for one micro-batch."""
        weight = wpo_weights(logps) if self.use_weighting else None
        components: dict[str, torch.Tensor] = {}
        total: torch.Tensor | None = None
        for name, fn, factor in self.terms:
            component = fn(logps, self.params, context)
            if weight is not None:
                component = component * weight
            components[name] = component
            total = factor * component if total is None else total + factor * component
        assert total is not None, "an Objective has at least one term (checked by the config)"
        return ObjectiveOutput(losses=total, components=components)
