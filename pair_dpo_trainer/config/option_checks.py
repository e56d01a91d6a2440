"""Each option's own range and its conflicts with other options: the value parsers and the checks that
:meth:`PairDPOConfig.option_problems <pair_dpo_trainer.config.arguments.PairDPOConfig.option_problems>` collects.

The checks read a ``PairDPOConfig`` (typed ``Any``: ``config.arguments`` imports this module). What needs a feature's
knowledge is checked by that feature (:mod:`pair_dpo_trainer.training.checks` collects those).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pair_dpo_trainer.errors import Problem

FP8_RECIPES = ("tensorwise", "rowwise")
"""``fp8`` values: torchao's float8 training recipes."""
REF_ZERO_STAGES = (0, 3)
"""``ref_zero_stage`` values besides None: 0 replicates the reference, 3 shards it like a ZeRO-3 policy."""


def _split(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def _as_float(value: Any) -> float:
    """A loss weight as a float (NaN when it is not a number, which the weight check reports)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _split_each(values: Any) -> list[Any]:
    """A string split at commas, or each string entry of a list split at commas (other entries kept)."""
    if isinstance(values, str):
        return _split(values)
    return [part for value in values for part in (_split(value) if isinstance(value, str) else [value])]


def normalize_loss_fields(loss_type: Any, loss_weights: Any) -> tuple[list[str], list[float] | None]:
    """``loss_type`` and ``loss_weights`` as lists, as TRL 1.16 stores them.

    A single string is one objective (TRL) or a comma-separated list (``"sigmoid,bco_pair,sft"``); flags give a list
    (``--loss_type sigmoid bco_pair sft --loss_weights 0.8 0.2 1.0``, or ``--loss_type sigmoid,sft``, which the
    argument parser passes as the one entry ``"sigmoid,sft"``), YAML/JSON a list. Every entry is split at commas.

    Example:
        >>> normalize_loss_fields("sigmoid, sft", "0.5,1")
        (['sigmoid', 'sft'], [0.5, 1.0])
        >>> normalize_loss_fields(["sigmoid,sft"], None)
        (['sigmoid', 'sft'], None)
    """
    types = [str(name) for name in _split_each(loss_type)]
    if loss_weights is None:
        return types, None
    return types, [_as_float(weight) for weight in _split_each(loss_weights)]


def ref_zero_stage_problem(stage: Any) -> str | None:
    """Why ``ref_zero_stage=stage`` is not a valid value (None, or the int 0 or 3), or None when it is."""
    if stage is None or (isinstance(stage, int) and not isinstance(stage, bool) and stage in REF_ZERO_STAGES):
        return None
    return f"ref_zero_stage={stage!r}: use None (follow the policy), 0 or 3."


def parse_activation_checkpointing(mode: Any) -> tuple[str, int] | None:
    """``(kind, every)`` of an ``activation_checkpointing_mode`` value, or None when it is not one.

    ``kind`` is ``off``, ``full``, ``selective``, ``auto`` or ``layers`` (every ``every``-th decoder layer; 1 for
    the others).

    Example:
        >>> parse_activation_checkpointing("layers:2"), parse_activation_checkpointing("full")
        (('layers', 2), ('full', 1))
        >>> parse_activation_checkpointing("layers:1") is None
        True
    """
    if not isinstance(mode, str):
        return None
    if mode in ("off", "full", "selective", "auto"):
        return mode, 1
    kind, _, every = mode.partition(":")
    if kind == "layers" and every.isdigit() and int(every) >= 2:
        return kind, int(every)
    return None


def parse_tiled_mlp(value: Any) -> int | str | None:
    """A ``tiled_mlp`` value as the tiles it asks for: None (off), ``"auto"`` or the tokens per tile (an int, or its
    decimal string as a command line gives it).

    Example:
        >>> parse_tiled_mlp(None), parse_tiled_mlp("auto"), parse_tiled_mlp("4096"), parse_tiled_mlp(2048)
        (None, 'auto', 4096, 2048)

    Raises:
        ValueError: Anything else (the message names the option and the values it takes).
    """
    if value is None or value == "auto":
        return value
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if _is_count(value, 1):
        return int(value)
    raise ValueError(
        f"tiled_mlp={value!r}: use None (off), 'auto' (tiles of about hidden_size tokens) or a positive number of "
        "tokens per tile."
    )


def _is_count(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def option_problems(config: Any) -> list[Problem]:
    """``(reason_code, message)`` for every option out of its own range or in conflict with another option."""
    return [
        *_objective_value_problems(config),
        *_loss_weight_problems(config),
        *_reference_layout_problems(config),
        *_length_problems(config),
        *_budget_problems(config),
        *_memory_problems(config),
        *_data_problems(config),
        *_share_prompt_problems(config),
        *_sequence_parallel_problems(config),
        *_timeout_problems(config),
        *_divergence_problems(config),
    ]


def _objective_value_problems(config: Any) -> list[Problem]:
    """The objectives' scalar hyper-parameters (which objective reads which: ``losses.checks``)."""
    problems: list[Problem] = []
    beta = config.beta
    if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta > 0):
        problems.append(("bad_beta", f"beta={beta!r}: set a finite value > 0 (typical: 0.1)."))
    if not 0.0 <= config.label_smoothing < 0.5:
        problems.append(
            ("bad_label_smoothing", f"label_smoothing={config.label_smoothing!r}: set a value in [0, 0.5).")
        )
    if not (math.isfinite(config.nll_weight) and config.nll_weight >= 0):
        problems.append(("bad_nll_weight", f"nll_weight={config.nll_weight!r}: set a finite value >= 0."))
    ld_alpha = config.ld_alpha
    checks = (
        (ld_alpha is None or 0.0 <= ld_alpha <= 1.0, f"ld_alpha={ld_alpha!r}: set a value in [0, 1], or None."),
        (math.isfinite(config.f_alpha_divergence_coef), "f_alpha_divergence_coef: set a finite value."),
        (math.isfinite(config.discopop_tau) and config.discopop_tau > 0, "discopop_tau: set a finite value > 0."),
        (math.isfinite(config.simpo_gamma), "simpo_gamma: set a finite value."),
        (0.0 < config.ref_model_mixup_alpha <= 1.0, "ref_model_mixup_alpha: set a value in (0, 1]."),
        (_is_count(config.ref_model_sync_steps, 1), "ref_model_sync_steps: set an integer >= 1."),
    )
    problems.extend(("bad_loss_option", text) for ok, text in checks if not ok)
    if config.sync_ref_model and config.precompute_ref_log_probs:
        problems.append(
            (
                "unsupported_combination",
                "sync_ref_model=True changes the reference during training, so its log-probs cannot be "
                "precomputed: set precompute_ref_log_probs=False.",
            )
        )
    if str(config.include_num_input_tokens_seen).lower() not in ("no", "false"):
        problems.append(
            (
                "unsupported_combination",
                "include_num_input_tokens_seen: pair DPO logs num_tokens itself; leave it at 'no'.",
            )
        )
    return problems


def _loss_weight_problems(config: Any) -> list[Problem]:
    """One finite weight >= 0 per ``loss_type`` entry, not all 0."""
    weights: Sequence[float] | None = config.loss_weights
    if weights is None or (
        len(weights) == len(config.loss_type)
        and all(math.isfinite(w) and w >= 0 for w in weights)
        and any(w > 0 for w in weights)
    ):
        return []
    message = (
        f"loss_weights={list(weights)!r}: give one finite weight >= 0 per loss_type entry ({len(config.loss_type)} "
        f"for {list(config.loss_type)}), not all 0; or leave it unset (all 1.0)."
    )
    return [("bad_loss_weights", message)]


def _reference_layout_problems(config: Any) -> list[Problem]:
    """``ref_zero_stage``, ``ref_fsdp_shard`` and ``ref_offload_params`` among themselves (what the run's
    DeepSpeed configuration or FSDP2 plugin allows is checked at trainer start, ``training.checks``)."""
    problems: list[Problem] = []
    stage_problem = ref_zero_stage_problem(config.ref_zero_stage)
    if stage_problem is not None:
        problems.append(("bad_ref_zero_stage", stage_problem))
    if config.ref_zero_stage == 0 and config.ref_offload_params:
        problems.append(
            (
                "unsupported_combination",
                "ref_zero_stage=0 replicates the reference on every accelerator, but ref_offload_params=True "
                "offloads the parameters of a sharded (ZeRO-3) reference: set ref_zero_stage=3 (or leave it "
                "unset) to offload, or ref_offload_params=False / unset to replicate.",
            )
        )
    shard = config.ref_fsdp_shard
    if shard is not None and not isinstance(shard, bool):
        problems.append(
            ("bad_ref_fsdp_shard", f"ref_fsdp_shard={shard!r}: use None (shard like the policy), True or False.")
        )
    elif shard is False and config.ref_offload_params:
        problems.append(
            (
                "unsupported_combination",
                "ref_fsdp_shard=False replicates the reference on every accelerator, but ref_offload_params=True "
                "offloads the parameters of a sharded reference: set one of them differently.",
            )
        )
    return problems


def _budget_problems(config: Any) -> list[Problem]:
    """``max_tokens_per_microbatch`` / ``pad_to_budget``."""
    budget = config.max_tokens_per_microbatch
    if budget is None:
        if config.pad_to_budget:
            return [
                (
                    "unsupported_combination",
                    "pad_to_budget=True pads rows to max_tokens_per_microbatch, which is not set: set "
                    "max_tokens_per_microbatch (e.g. 16384) or pad_to_budget=False.",
                )
            ]
        return []
    if not _is_count(budget, 1):
        return [("bad_length", f"max_tokens_per_microbatch={budget!r}: set a positive integer or None.")]
    if config.gradient_accumulation_steps != 1:
        return [
            (
                "unsupported_combination",
                f"max_tokens_per_microbatch={budget} sizes the micro-batches by tokens, so their number per step "
                "follows from the budget, not from gradient_accumulation_steps="
                f"{config.gradient_accumulation_steps}: "
                "set gradient_accumulation_steps=1 and per_device_train_batch_size to the pairs per GPU per "
                f"optimizer step (here {config.pairs_per_rank_per_step}), or unset max_tokens_per_microbatch.",
            )
        ]
    return []


def _memory_problems(config: Any) -> list[Problem]:
    """``fp8``, ``activation_checkpointing_mode``, ``activation_offload`` and ``tiled_mlp`` values and their
    combinations."""
    problems: list[Problem] = []
    if config.fp8 is not None and config.fp8 not in FP8_RECIPES:
        problems.append(("bad_fp8", f"fp8={config.fp8!r}: use one of {list(FP8_RECIPES)}, or None (off)."))
    mode = config.activation_checkpointing_mode
    if parse_activation_checkpointing(mode) is None:
        problems.append(
            (
                "bad_activation_checkpointing",
                f"activation_checkpointing_mode={mode!r}: use 'off', 'full', 'selective', 'auto' or 'layers:K' "
                "with an integer K >= 2 (every K-th decoder layer).",
            )
        )
    elif mode != "off" and (config.gradient_checkpointing or getattr(config, "activation_checkpointing", False)):
        problems.append(
            (
                "unsupported_combination",
                f"activation_checkpointing_mode={mode!r} and gradient_checkpointing=True would checkpoint the "
                "layers twice: keep one (activation_checkpointing_mode='full' is the same as "
                "gradient_checkpointing).",
            )
        )
    try:
        parse_tiled_mlp(config.tiled_mlp)
    except ValueError as exc:
        problems.append(("bad_tiled_mlp", str(exc)))
    if mode == "auto" and config.max_tokens_per_microbatch is None:
        problems.append(
            (
                "unsupported_combination",
                "activation_checkpointing_mode='auto' picks the cheapest setting that fits the token budget, but "
                "max_tokens_per_microbatch is not set: set it (e.g. 16384), or name a mode.",
            )
        )
    return problems


def _data_problems(config: Any) -> list[Problem]:
    """``dataset_num_proc``: None or a positive worker count."""
    num_proc = config.dataset_num_proc
    if num_proc is None or _is_count(num_proc, 1):
        return []
    message = f"dataset_num_proc={num_proc!r}: set a worker count >= 1, or None (all usable cores)."
    return [("bad_num_proc", message)]


def _sequence_parallel_problems(config: Any) -> list[Problem]:
    """``sequence_parallel_size``: a count >= 1 (its fit with the world and the model is checked at run time), the
    one way to ask for it (Accelerate's ``parallelism_config`` would split the row without knowing its pairs)."""
    problems: list[Problem] = []
    size = config.sequence_parallel_size
    if not _is_count(size, 1):
        problems.append(("bad_sequence_parallel_size", f"sequence_parallel_size={size!r}: use an int >= 1 (1: off)."))
    if getattr(config, "parallelism_config", None) is not None:
        problems.append(
            (
                "unsupported_combination",
                "parallelism_config: Accelerate's sequence/context parallelism slices rows without their pair "
                "boundaries; set parallelism_config=None and sequence_parallel_size=N (Ulysses over the packed "
                "pairs) instead.",
            )
        )
    return problems


def _share_prompt_problems(config: Any) -> list[Problem]:
    """``share_prompt``: None (where supported), True or False."""
    if config.share_prompt is None or isinstance(config.share_prompt, bool):
        return []
    message = f"share_prompt={config.share_prompt!r}: use None (on where supported), True (required) or False."
    return [("bad_share_prompt", message)]


def _timeout_problems(config: Any) -> list[Problem]:
    """``ddp_timeout``: the seconds every collective may wait for its peers. 0 or less lets none wait, so the job
    would end in a raw gloo / NCCL timeout at its first collective instead of here."""
    timeout = config.ddp_timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and math.isfinite(timeout):
        if timeout > 0:
            return []
    message = (
        f"ddp_timeout={timeout!r} (--ddp_timeout): set a positive number of seconds a collective may wait for "
        "its peers (the default: 1800)."
    )
    return [("bad_timeout", message)]


def _divergence_problems(config: Any) -> list[Problem]:
    """``max_nonfinite_grad_skips``: a count of skipped optimizer steps (``training.nonfinite``)."""
    if _is_count(config.max_nonfinite_grad_skips, 0):
        return []
    message = (
        f"max_nonfinite_grad_skips={config.max_nonfinite_grad_skips!r} (--max_nonfinite_grad_skips): set an "
        "integer >= 0, how many optimizer steps with a NaN/inf gradient norm may be skipped before the run "
        "stops (0: stop at the first; default 10)."
    )
    return [("bad_nonfinite_skips", message)]


def _length_problems(config: Any) -> list[Problem]:
    problems: list[Problem] = []
    if config.max_length <= 1:
        problems.append(("bad_length", f"max_length={config.max_length}: set a value > 1."))
    if config.max_prompt_length is None or not 0 < config.max_prompt_length < config.max_length:
        problems.append(
            (
                "bad_length",
                f"max_prompt_length={config.max_prompt_length}: set 0 < max_prompt_length < max_length "
                f"({config.max_length}) so every completion keeps at least one token.",
            )
        )
    if config.logps_chunk_size <= 0:
        problems.append(("bad_length", f"logps_chunk_size={config.logps_chunk_size}: set a value > 0."))
    if config.per_device_train_batch_size < 1:
        problems.append(("bad_batch_size", "per_device_train_batch_size (pairs per micro-batch) must be >= 1."))
    return problems
