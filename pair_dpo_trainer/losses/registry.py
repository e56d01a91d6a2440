"""Every objective by name, with what it needs: the one table the checks, the trainer and the docs read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pair_dpo_trainer.losses import aot, pairwise, reference_free  # the submodules, not the package's names
from pair_dpo_trainer.losses.base import LossFn


@dataclass(frozen=True)
class ObjectiveSpec:
    """What an objective needs from the run.

    Attributes:
        fn: The pure per-pair loss.
        reference: Needs reference log-probs (False: SimPO, ORPO, sft build no reference).
        label_smoothing: ``"none"`` (a value > 0 is refused: the paper gives it no meaning), ``"optional"``
            (cDPO / rDPO noise rate) or ``"required"`` (EXO's eps, must be > 0).
        f_divergence: Built on the chosen-rejected reward difference, so ``f_divergence_type`` applies (TRL's set).
        sorts_step: Sorts over the optimizer step's pairs (AOT): the trainer runs the gradient-free pre-pass.
        token_mean: A token mean over the step's chosen tokens (``sft``): the trainer counts them per step.
        sequence_nll: An NLL over the chosen prompt and completion tokens (``orpo``, as TRL's ``ORPOTrainer``): the
            collator lists the chosen prompt positions, the policy pass scores them, the trainer counts them per
            step.
        stateful: Reads a running statistic of previous steps (BCO's reward shift).
        trl: TRL 1.16's ``loss_type`` for the same objective, or None when TRL's DPOTrainer has none.
    """

    fn: LossFn
    reference: bool = True
    label_smoothing: str = "none"
    f_divergence: bool = False
    sorts_step: bool = False
    token_mean: bool = False
    sequence_nll: bool = False
    stateful: bool = False
    trl: str | None = None


OBJECTIVES: dict[str, ObjectiveSpec] = {
    "sigmoid": ObjectiveSpec(pairwise.sigmoid_loss, label_smoothing="optional", f_divergence=True, trl="sigmoid"),
    "robust": ObjectiveSpec(pairwise.robust_loss, label_smoothing="optional", f_divergence=True, trl="robust"),
    "ipo": ObjectiveSpec(pairwise.ipo_loss, f_divergence=True, trl="ipo"),
    "ipo_sum": ObjectiveSpec(pairwise.ipo_sum_loss, f_divergence=True),
    "hinge": ObjectiveSpec(pairwise.hinge_loss, f_divergence=True, trl="hinge"),
    "exo_pair": ObjectiveSpec(pairwise.exo_pair_loss, label_smoothing="required", f_divergence=True, trl="exo_pair"),
    "nca_pair": ObjectiveSpec(pairwise.nca_pair_loss, trl="nca_pair"),
    "bco_pair": ObjectiveSpec(pairwise.bco_pair_loss, trl="bco_pair"),
    "bco_pair_shift": ObjectiveSpec(pairwise.bco_pair_shift_loss, stateful=True),
    "sppo_hard": ObjectiveSpec(pairwise.sppo_hard_loss, trl="sppo_hard"),
    "aot": ObjectiveSpec(aot.aot_loss, label_smoothing="optional", sorts_step=True, trl="aot"),
    "aot_unpaired": ObjectiveSpec(
        aot.aot_unpaired_loss, label_smoothing="optional", sorts_step=True, trl="aot_unpaired"
    ),
    "apo_zero": ObjectiveSpec(pairwise.apo_zero_loss, trl="apo_zero"),
    "apo_down": ObjectiveSpec(pairwise.apo_down_loss, trl="apo_down"),
    "discopop": ObjectiveSpec(pairwise.discopop_loss, f_divergence=True, trl="discopop"),
    "sigmoid_norm": ObjectiveSpec(pairwise.sigmoid_norm_loss, f_divergence=True, trl="sigmoid_norm"),
    "sigmoid_nll": ObjectiveSpec(pairwise.sigmoid_nll_loss, f_divergence=True),
    "sft": ObjectiveSpec(reference_free.sft_loss, reference=False, f_divergence=True, token_mean=True, trl="sft"),
    "simpo": ObjectiveSpec(reference_free.simpo_loss, reference=False, label_smoothing="optional"),
    "orpo": ObjectiveSpec(reference_free.orpo_loss, reference=False, sequence_nll=True),
}
"""Objective name -> spec. ``sft`` accepts a non-default ``f_divergence_type`` as TRL does (it has no log-ratio,
so the choice changes nothing for it)."""

LOSS_FUNCTIONS: dict[str, LossFn] = {name: spec.fn for name, spec in OBJECTIVES.items()}
"""Objective name -> pure loss ``(logps, params, context=NO_CONTEXT) -> [n]``."""

LABEL_SMOOTHING_LOSSES = frozenset(name for name, spec in OBJECTIVES.items() if spec.label_smoothing != "none")
"""Objectives for which ``label_smoothing`` has a meaning."""

LABEL_FREE_LOSSES = frozenset({"sft"})
"""Objectives without a preference label, unaffected by ``label_smoothing`` (allowed in a smoothed mixture)."""


def scores_chosen_prompts(loss_type: Sequence[str]) -> bool:
    """True when an objective of ``loss_type`` reads the chosen prompts' log-probs (``orpo``)."""
    return any(OBJECTIVES[name].sequence_nll for name in loss_type if name in OBJECTIVES)


STEP_QUANTITIES = ("sorts_step", "token_mean", "sequence_nll", "stateful")
"""The :class:`ObjectiveSpec` flags of objectives that read quantities of the whole optimizer step (or of earlier
steps), gathered over the ranks."""


def step_level_objectives(loss_type: Sequence[str]) -> list[str]:
    """The objectives of ``loss_type`` that read quantities of the whole step (:data:`STEP_QUANTITIES`).

    Example:
        >>> step_level_objectives(["sigmoid", "sft", "aot"])
        ['sft', 'aot']
    """
    return [
        name
        for name in loss_type
        if name in OBJECTIVES and any(getattr(OBJECTIVES[name], flag) for flag in STEP_QUANTITIES)
    ]


REFERENCE_FREE_LOSSES = frozenset(name for name, spec in OBJECTIVES.items() if not spec.reference)
"""Objectives that need no reference model."""


def uses_reference(loss_type: Sequence[str], *, reference_free: bool = False) -> bool:
    """False when the run builds no reference: ``reference_free=True`` or only reference-free objectives
    (``simpo``, ``orpo``, ``sft``). An unknown name counts as needing one (it is refused by ``losses.checks``).

    Example:
        >>> uses_reference(["sigmoid", "sft"]), uses_reference(["orpo", "sft"])
        (True, False)
    """
    return not reference_free and any(OBJECTIVES[name].reference if name in OBJECTIVES else True for name in loss_type)


def no_reference_reason(loss_type: Sequence[str], *, reference_free: bool = False) -> str:
    """Why a run builds no reference, for messages (``reference_free=True`` or the reference-free losses)."""
    return "reference_free=True" if reference_free else f"loss_type={list(loss_type)} (reference-free)"
