"""The settings a checkpoint records so that a resumed run trains the same pairs towards the same objective.

A checkpoint's step counter, optimizer moments and schedule position mean something only for the data they were
computed on and the loss they descended. Two groups of options change those and are compared on resume
(``fault_tolerance/resume.py``, ``check_resumed_settings``):

- **data**: what turns the same rows into other token ids: ``max_length`` and ``max_prompt_length`` (they decide
  which pairs are truncated and where), ``apply_chat_template_to_strings`` (templated or raw text) and the tokenizer
  (its fingerprint, :func:`pair_dpo_trainer.data.tokenizer_fingerprint`); and the packed layout (``layout``:
  ``"shared_prompt"``, absent for the unshared one), which changes a pair's token cost and so how the schedule
  spreads the pairs over ranks and micro-batches. A change is ``resume_data_mismatch``.
- **objective**: the loss and its hyper-parameters (``loss_type``, ``loss_weights``, ``beta``, ...) and what makes the
  reference part of the objective (``reference_free``, TR-DPO's sync). A change is ``resume_objective_mismatch``.

Every other option may change on resume (learning rate and its schedule, logging, evaluation and save cadence,
``max_steps``, memory and speed options such as ``attn_backend`` or activation checkpointing); docs/guide.md section 12
lists them. ``allow_resume_data_mismatch`` resumes anyway, with a warning that lists each difference.
"""

from __future__ import annotations

from typing import Any

from torch.optim.lr_scheduler import LambdaLR

from pair_dpo_trainer.data import tokenizer_fingerprint
from pair_dpo_trainer.errors import ConfigError

DATA_OPTIONS = ("max_length", "max_prompt_length", "apply_chat_template_to_strings")
"""Options that change the token ids of a pair (besides the tokenizer)."""

OBJECTIVE_OPTIONS = (
    "loss_type",
    "loss_weights",
    "beta",
    "label_smoothing",
    "nll_weight",
    "use_weighting",
    "ld_alpha",
    "f_divergence_type",
    "f_alpha_divergence_coef",
    "discopop_tau",
    "simpo_gamma",
    "reference_free",
    "sync_ref_model",
    "ref_model_mixup_alpha",
    "ref_model_sync_steps",
)
"""Options of the loss: each changes the function the optimizer state descended."""


def resume_settings(args: Any, tokenizer: Any, *, share_prompt: bool = False) -> dict[str, dict[str, Any]]:
    """The run's settings in both groups, as JSON values (what the checkpoint manifest records).

    Args:
        args: The run's ``PairDPOConfig`` (plain ``TrainingArguments`` lack the pair options: they record None).
        tokenizer: The trainer's ``processing_class`` (None: the dataset came tokenised and none was given).
        share_prompt: The run packs the shared-prompt layout (recorded as ``data["layout"]``).

    Returns:
        ``{"data": {option: value, "tokenizer": fingerprint}, "objective": {option: value}}``.
    """
    data = {name: _plain(getattr(args, name, None)) for name in DATA_OPTIONS}
    data["tokenizer"] = None if tokenizer is None else tokenizer_fingerprint(getattr(tokenizer, "tokenizer", tokenizer))
    if share_prompt:
        data["layout"] = "shared_prompt"
    objective = {name: _plain(getattr(args, name, None)) for name in OBJECTIVE_OPTIONS}
    return {"data": data, "objective": objective}


def _plain(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_plain(item) for item in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int | float):
        return float(value) if isinstance(value, float) else int(value)
    return str(value)


def base_learning_rates(scheduler: Any) -> list[float] | None:
    """The scheduler's base learning rates (one per parameter group) as this run configured them, before a
    checkpoint's scheduler state replaces them (None for a scheduler without ``base_lrs``)."""
    base = getattr(scheduler, "base_lrs", None)
    return None if base is None else [float(lr) for lr in base]


def keep_configured_learning_rates(scheduler: Any, configured: list[float] | None) -> str | None:
    """Puts this run's base learning rates back after a checkpoint's scheduler state was loaded.

    torch's ``LRScheduler.load_state_dict`` restores the checkpoint's ``base_lrs``, so a learning rate changed on resume
    would silently not apply. The schedule's position (``last_epoch``) is the checkpoint's and its shape (the
    ``lr_lambdas``: warmup, decay over ``max_steps``) this run's; every group's current rate becomes
    ``configured * lambda(last_epoch)``, as in an uninterrupted run with these options.

    Args:
        scheduler: ``Trainer.lr_scheduler`` after the checkpoint was loaded.
        configured: :func:`base_learning_rates` of the same scheduler before the load.

    Returns:
        What changed, to log (None when nothing did).

    Raises:
        ConfigError: ``unsupported_combination`` when the learning rate changed under a scheduler that has no
            per-group multipliers to re-apply it to (anything but ``LambdaLR``, e.g. ``reduce_lr_on_plateau``).
    """
    restored = base_learning_rates(scheduler)
    if configured is None or restored is None or restored == configured:
        return None
    if not isinstance(scheduler, LambdaLR) or len(restored) != len(configured):
        raise ConfigError(
            "unsupported_combination",
            f"learning_rate changed on resume ({restored[0]:g} in the checkpoint, {configured[0]:g} now) under "
            f"lr_scheduler {type(scheduler).__name__}, whose state cannot take another base rate: resume with the "
            "checkpoint's learning_rate, or use a LambdaLR schedule (linear, cosine, constant_with_warmup, ...).",
        )
    scheduler.base_lrs = list(configured)
    groups = scheduler.optimizer.param_groups
    for group, base, multiplier in zip(groups, configured, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = base
        group["lr"] = base * multiplier(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in groups]
    return f"base learning rate {restored[0]:g} (checkpoint) -> {configured[0]:g} (this run)"


def keep_configured_cadence(state: Any, args: Any) -> str | None:
    """Puts this run's ``logging_steps`` / ``eval_steps`` / ``save_steps`` back after ``trainer_state.json`` of a
    checkpoint replaced them (HF's Trainer otherwise keeps the checkpoint's and only warns that they differ).

    Returns:
        What changed, to log (None when nothing did).
    """
    before = {kind: getattr(state, f"{kind}_steps", None) for kind in ("logging", "eval", "save")}
    state.compute_steps(args, state.max_steps)
    changed = [
        f"{kind}_steps {value} -> {getattr(state, f'{kind}_steps')}"
        for kind, value in before.items()
        if value != getattr(state, f"{kind}_steps")
    ]
    return ", ".join(changed) or None
