"""The preference objectives as pure functions over per-pair log-probabilities (a dict of functions, no branches).

Every objective takes a :class:`PairLogps` (``[n]`` tensors, one entry per pair), a :class:`LossParams` and a
:class:`StepContext` (optional) and returns per-pair losses ``[n]``; :class:`Objective` combines several with
``loss_weights``. The trainer sums the per-pair totals and divides by the global pair count of the optimizer step;
nothing here knows about ranks or accumulation, except through the step context the trainer builds
(:mod:`pair_dpo_trainer.training.step_context`). The table of objectives, papers and hyper-parameters is docs/losses.md.

Example:
    >>> import torch
    >>> z = torch.zeros(2)
    >>> logps = PairLogps(z, z, z, z, chosen_token_counts=torch.ones(2), rejected_token_counts=torch.ones(2))
    >>> LOSS_FUNCTIONS["sigmoid"](logps, LossParams(beta=0.1)).tolist()   # ln 2 per pair at step 0
    [0.6931471824645996, 0.6931471824645996]
"""

from pair_dpo_trainer.losses.base import (
    NO_CONTEXT,
    AotMatch,
    LossFn,
    LossParams,
    PairLogps,
    StepContext,
)
from pair_dpo_trainer.losses.objective import Objective, ObjectiveOutput, wpo_weights
from pair_dpo_trainer.losses.registry import (
    LABEL_FREE_LOSSES,
    LABEL_SMOOTHING_LOSSES,
    LOSS_FUNCTIONS,
    OBJECTIVES,
    REFERENCE_FREE_LOSSES,
    ObjectiveSpec,
)

__all__ = [
    "LABEL_FREE_LOSSES",
    "LABEL_SMOOTHING_LOSSES",
    "LOSS_FUNCTIONS",
    "NO_CONTEXT",
    "OBJECTIVES",
    "REFERENCE_FREE_LOSSES",
    "AotMatch",
    "LossFn",
    "LossParams",
    "Objective",
    "ObjectiveOutput",
    "ObjectiveSpec",
    "PairLogps",
    "StepContext",
    "wpo_weights",
]
