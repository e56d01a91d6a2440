"""Validation of the objective options of ``PairDPOConfig`` (called by its ``_loss_problems``).

Every function returns ``(reason_code, message)`` pairs (or messages of one code); the config collects them with
its other problems and raises once. An unsupported combination is refused, never silently ignored.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pair_dpo_trainer.losses.base import F_DIVERGENCES
from pair_dpo_trainer.losses.registry import LABEL_FREE_LOSSES, LABEL_SMOOTHING_LOSSES, OBJECTIVES

Problem = tuple[str, str]


def _as_float(value: Any) -> float:
    """A loss weight as a float (NaN when it is not a number, which :func:`loss_type_problems` reports)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _split(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def normalize_loss_fields(loss_type: Any, loss_weights: Any) -> tuple[list[str], list[float] | None]:
    """``loss_type`` and ``loss_weights`` as lists, as TRL 1.16 stores them.

    A single string is one objective (TRL) or a comma-separated list (``"sigmoid,bco_pair,sft"``); flags give a list
    (``--loss_type sigmoid bco_pair sft --loss_weights 0.8 0.2 1.0``), YAML/JSON a list.

    Example:
        >>> normalize_loss_fields("sigmoid, sft", "0.5,1")
        (['sigmoid', 'sft'], [0.5, 1.0])
    """
    types = _split(loss_type) if isinstance(loss_type, str) else [str(name) for name in loss_type]
    if loss_weights is None:
        return types, None
    weights = _split(loss_weights) if isinstance(loss_weights, str) else list(loss_weights)
    return types, [_as_float(weight) for weight in weights]


def loss_problems(config: Any) -> list[Problem]:
    """Every invalid objective option of ``config`` (a ``PairDPOConfig`` after :func:`normalize_loss_fields`)."""
    problems: list[Problem] = []
    beta = config.beta
    if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta > 0):
        problems.append(("bad_beta", f"beta={beta!r}: set a finite value > 0 (typical: 0.1)."))
    problems.extend(loss_type_problems(config.loss_type, config.loss_weights))
    known = [name for name in config.loss_type if name in OBJECTIVES]
    problems.extend(label_smoothing_problems(config.label_smoothing, known))
    if not (math.isfinite(config.nll_weight) and config.nll_weight >= 0):
        problems.append(("bad_nll_weight", f"nll_weight={config.nll_weight!r}: set a finite value >= 0."))
    problems.extend(("bad_loss_option", text) for text in loss_option_problems(config))
    problems.extend(("unsupported_combination", text) for text in loss_combination_problems(config, known))
    return problems


def loss_type_problems(loss_type: Sequence[str], loss_weights: Sequence[float] | None) -> list[Problem]:
    """Unknown or repeated objective names; weights that do not match them."""
    problems: list[Problem] = []
    unknown = [name for name in loss_type if name not in OBJECTIVES]
    if unknown or not loss_type:
        problems.append(
            ("unknown_loss_type", f"loss_type={list(loss_type)!r}: use one or more of {sorted(OBJECTIVES)}.")
        )
    repeated = sorted({name for name in loss_type if list(loss_type).count(name) > 1})
    if repeated:
        problems.append(
            ("duplicate_loss_type", f"loss_type lists {repeated} more than once: list each objective once.")
        )
    weights = loss_weights
    if weights is not None and (
        len(weights) != len(loss_type)
        or not all(math.isfinite(w) and w >= 0 for w in weights)
        or not any(w > 0 for w in weights)
    ):
        problems.append(
            (
                "bad_loss_weights",
                f"loss_weights={list(weights)!r}: give one finite weight >= 0 per loss_type entry ({len(loss_type)} "
                f"for {list(loss_type)}), not all 0; or leave it unset (all 1.0).",
            )
        )
    return problems


def label_smoothing_problems(label_smoothing: float, known: Sequence[str]) -> list[Problem]:
    """``label_smoothing`` is honoured only where a paper gives it a meaning (cDPO / rDPO / EXO / AOT / SimPO)."""
    if not 0.0 <= label_smoothing < 0.5:
        return [("bad_label_smoothing", f"label_smoothing={label_smoothing!r}: set a value in [0, 0.5).")]
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


def loss_option_problems(config: Any) -> list[str]:
    """Out-of-range objective hyper-parameters (reason code ``bad_loss_option``)."""
    ld_alpha = config.ld_alpha
    checks = (
        (ld_alpha is None or 0.0 <= ld_alpha <= 1.0, f"ld_alpha={ld_alpha!r}: set a value in [0, 1], or None."),
        (
            config.f_divergence_type in F_DIVERGENCES,
            f"f_divergence_type={config.f_divergence_type!r}: use one of {sorted(F_DIVERGENCES)}.",
        ),
        (math.isfinite(config.f_alpha_divergence_coef), "f_alpha_divergence_coef: set a finite value."),
        (math.isfinite(config.discopop_tau) and config.discopop_tau > 0, "discopop_tau: set a finite value > 0."),
        (math.isfinite(config.simpo_gamma), "simpo_gamma: set a finite value."),
        (0.0 < config.ref_model_mixup_alpha <= 1.0, "ref_model_mixup_alpha: set a value in (0, 1]."),
        (config.ref_model_sync_steps >= 1, "ref_model_sync_steps: set an integer >= 1."),
    )
    return [text for ok, text in checks if not ok]


def loss_combination_problems(config: Any, known: Sequence[str]) -> list[str]:
    """Objective options that cannot apply together (reason code ``unsupported_combination``)."""
    problems: list[str] = []
    plain = sorted({name for name in known if not OBJECTIVES[name].f_divergence})
    if config.f_divergence_type != "reverse_kl" and plain:
        problems.append(
            f"f_divergence_type={config.f_divergence_type!r} applies only to objectives on the chosen-rejected "
            f"reward difference; {plain} have no f-divergence form (f-DPO's log Z term cancels only in that "
            "difference): use f_divergence_type='reverse_kl' or other objectives."
        )
    sorting = sorted({name for name in known if OBJECTIVES[name].sorts_step})
    if config.use_weighting and sorting:
        problems.append(
            f"use_weighting (WPO) cannot weight {sorting}: they sort pairs, so a pair's loss is not its own."
        )
    if config.sync_ref_model and not config.uses_reference:
        problems.append("sync_ref_model=True updates a reference, but this run builds none (reference-free).")
    if config.sync_ref_model and config.precompute_ref_log_probs:
        problems.append(
            "sync_ref_model=True changes the reference during training, so its log-probs cannot be precomputed: set "
            "precompute_ref_log_probs=False."
        )
    if str(getattr(config, "include_num_input_tokens_seen", "no")).lower() not in ("no", "false"):
        problems.append("include_num_input_tokens_seen: pair DPO logs num_tokens itself; leave it at 'no'.")
    return problems
