"""Which objective options fit the chosen objectives: names, and what each objective gives a meaning to.

The options' own ranges are checked by ``PairDPOConfig``; these checks need the objective table and are collected
with the other features' checks at trainer start (``training.checks.check_config``). An unsupported combination is
refused, never silently ignored.
"""

from __future__ import annotations

from collections.abc import Sequence

from pair_dpo_trainer.config.sections import ObjectiveOptions, ReferenceOptions
from pair_dpo_trainer.config.trl_names import RENAMED_LOSS_TYPES
from pair_dpo_trainer.errors import Problem
from pair_dpo_trainer.losses.base import F_DIVERGENCES
from pair_dpo_trainer.losses.registry import LABEL_FREE_LOSSES, LABEL_SMOOTHING_LOSSES, OBJECTIVES


def loss_problems(objective: ObjectiveOptions, reference: ReferenceOptions) -> list[Problem]:
    """Every objective option that the run's objectives refuse (``reference``: whether the run has one to sync)."""
    problems: list[Problem] = list(loss_type_problems(objective.loss_type))
    known = [name for name in objective.loss_type if name in OBJECTIVES]
    problems.extend(label_smoothing_problems(objective.label_smoothing, known))
    if objective.f_divergence_type not in F_DIVERGENCES:
        problems.append(
            (
                "bad_loss_option",
                f"f_divergence_type={objective.f_divergence_type!r}: use one of {sorted(F_DIVERGENCES)}.",
            )
        )
    combinations = loss_combination_problems(objective, reference, known)
    problems.extend(("unsupported_combination", text) for text in combinations)
    return problems


def loss_type_problems(loss_type: Sequence[str]) -> list[Problem]:
    """Unknown or repeated objective names."""
    problems: list[Problem] = []
    renamed = [name for name in loss_type if name in RENAMED_LOSS_TYPES]
    problems.extend(("unknown_loss_type", f"loss_type {name!r}: use {RENAMED_LOSS_TYPES[name]}.") for name in renamed)
    unknown = [name for name in loss_type if name not in OBJECTIVES and name not in RENAMED_LOSS_TYPES]
    if unknown or not loss_type:
        problems.append(
            ("unknown_loss_type", f"loss_type={list(loss_type)!r}: use one or more of {sorted(OBJECTIVES)}.")
        )
    repeated = sorted({name for name in loss_type if list(loss_type).count(name) > 1})
    if repeated:
        problems.append(
            ("duplicate_loss_type", f"loss_type lists {repeated} more than once: list each objective once.")
        )
    return problems


def label_smoothing_problems(label_smoothing: float, known: Sequence[str]) -> list[Problem]:
    """``label_smoothing`` is honoured only where a paper gives it a meaning (cDPO / rDPO / EXO / AOT / SimPO); its
    range is ``PairDPOConfig``'s check."""
    problems: list[Problem] = []
    ignored = sorted({name for name in known if name not in LABEL_SMOOTHING_LOSSES | LABEL_FREE_LOSSES})
    if label_smoothing > 0 and ignored:
        problems.append(
            (
                "unsupported_combination",
                f"label_smoothing > 0 has no meaning for loss_type {ignored}: use objectives among "
                f"{sorted(LABEL_SMOOTHING_LOSSES)} (or 'sft') or set label_smoothing=0.",
            )
        )
    required = sorted({name for name in known if OBJECTIVES[name].label_smoothing == "required"})
    if label_smoothing == 0 and required:
        problems.append(
            (
                "bad_label_smoothing",
                f"loss_type {required} needs label_smoothing > 0 (EXO's epsilon; log(epsilon) is -inf at 0): the EXO "
                "paper uses 1e-3.",
            )
        )
    return problems


def loss_combination_problems(
    objective: ObjectiveOptions, reference: ReferenceOptions, known: Sequence[str]
) -> list[str]:
    """Objective options that cannot apply together (reason code ``unsupported_combination``)."""
    problems: list[str] = []
    plain = sorted({name for name in known if not OBJECTIVES[name].f_divergence})
    if objective.f_divergence_type != "reverse_kl" and plain:
        problems.append(
            f"f_divergence_type={objective.f_divergence_type!r} applies only to objectives on the chosen-rejected "
            f"reward difference; {plain} have no f-divergence form (f-DPO's log Z term cancels only in that "
            "difference): use f_divergence_type='reverse_kl' or other objectives."
        )
    sorting = sorted({name for name in known if OBJECTIVES[name].sorts_step})
    if objective.use_weighting and sorting:
        problems.append(
            f"use_weighting (WPO) cannot weight {sorting}: they sort pairs, so a pair's loss is not its own."
        )
    if reference.sync_ref_model and not reference.uses_reference:
        problems.append("sync_ref_model=True updates a reference, but this run builds none (reference-free).")
    return problems
