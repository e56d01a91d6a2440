"""Which checkpoint a run resumes from, and whether that checkpoint belongs to this run's data.

``resume_from_checkpoint`` accepts, in ``PairDPOTrainer.train`` and as ``--resume_from_checkpoint`` of ``train.py``
(where ``TrainingArguments`` keeps it as a string):

Details: fault_tolerance/README.md, "Module notes", ``resume.py``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pair_dpo_trainer.errors import CheckpointError
from pair_dpo_trainer.fault_tolerance.checkpoint import (
    MANIFEST_FILENAME,
    checkpoint_problem,
    checkpoint_step,
    list_checkpoints,
    load_manifest,
    read_manifest,
    staged_leftovers,
)

logger = logging.getLogger(__name__)

LATEST = ("true", "latest")
AUTO = "auto"
NO_RESUME = ("false", "none", "")


def resolve_resume(value: str | bool | None, output_dir: str, *, warn: bool = True) -> str | None:
    """The checkpoint directory to resume from (None: start fresh), following the module's rules.

    Args:
        value: ``resume_from_checkpoint`` as given.
        output_dir: The run's output directory (where ``latest`` looks).
        warn: Log the skipped checkpoints (the main process does; the others resolve silently).

    Raises:
        CheckpointError: ``no_checkpoint`` (nothing complete to resume from, or no such path),
            ``checkpoint_incomplete`` (an explicit path whose files do not match its manifest).
    """
    if value is None or value is False:
        return None
    word = value.strip().lower() if isinstance(value, str) else None
    if word in NO_RESUME:
        return None
    if value is True or word in LATEST or word == AUTO:
        found = latest_complete_checkpoint(output_dir, warn=warn)
        if found is not None:
            return found
        if word == AUTO:
            if warn:
                logger.warning("resume_from_checkpoint=auto: no complete checkpoint in %s, starting fresh", output_dir)
            return None
        raise CheckpointError(
            "no_checkpoint",
            f"resume_from_checkpoint={value!r}: no complete checkpoint in {output_dir} (see the warnings above for "
            "incomplete ones). Start without --resume_from_checkpoint, use 'auto' (resume if there is one), or pass "
            "a checkpoint directory.",
        )
    return _explicit(str(value), warn=warn)


def _explicit(path: str, *, warn: bool) -> str:
    if not Path(path).is_dir():
        raise CheckpointError(
            "no_checkpoint",
            f"resume_from_checkpoint={path!r}: no such checkpoint directory. Pass an existing checkpoint-N directory, "
            "or 'latest' for the newest complete checkpoint of output_dir.",
        )
    problem = checkpoint_problem(path)
    if problem is None:
        return path
    manifest, refused = load_manifest(path)
    if manifest is None:
        if warn and refused is None:  # a manifest that is there but refused: checkpoint_trust.py says why
            logger.warning(
                "resume_from_checkpoint=%s has no %s (saved by an older pair_dpo_trainer or another trainer): its "
                "completeness, file hashes and data cannot be checked; resuming as asked once its pickles are "
                "scanned for code.",
                path,
                MANIFEST_FILENAME,
            )
        return path
    raise CheckpointError(
        "checkpoint_incomplete",
        f"resume_from_checkpoint={path!r} is incomplete: {problem}. Resume from an earlier checkpoint, or use "
        "'latest' (the newest complete one).",
    )


def is_explicit(value: str | bool | None) -> bool:
    """Whether ``resume_from_checkpoint`` names a checkpoint directory (not ``latest`` / ``auto`` / no resume)."""
    if not isinstance(value, str):
        return False
    word = value.strip().lower()
    return word not in (*LATEST, AUTO, *NO_RESUME)


def newer_checkpoints(output_dir: str | os.PathLike[str], resumed: str) -> list[Path]:
    """The ``checkpoint-N`` directories of ``output_dir`` (complete or not) newer than the ``resumed`` checkpoint: the
    line an explicit resume of an older step abandons (``latest`` / ``auto`` would otherwise pick them up again)."""
    step = checkpoint_step(Path(resumed))
    if step is None:
        step = (read_manifest(resumed) or {}).get("step")
    if not isinstance(step, int):
        return []
    return [path for n, path in list_checkpoints(output_dir) if n > step]


def latest_complete_checkpoint(output_dir: str | os.PathLike[str], *, warn: bool = True) -> str | None:
    """The newest complete ``checkpoint-N`` of ``output_dir``, or None; newer incomplete ones are warned about."""
    if warn:
        for leftover in staged_leftovers(output_dir):
            logger.warning("ignoring %s: a save that was interrupted before it completed", leftover)
    for _, path in reversed(list_checkpoints(output_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            return str(path)
        if warn:
            logger.warning("skipping incomplete checkpoint %s: %s", path, problem)
    return None


def check_resumed_schedule(checkpoint: str, fingerprint: str, *, allow_mismatch: bool, warn: bool = True) -> None:
    """Refuses to resume ``checkpoint`` with a different train schedule.

    Raises:
        CheckpointError: ``resume_data_mismatch`` unless ``allow_mismatch``.
    """
    manifest = read_manifest(checkpoint) or {}
    recorded = manifest.get("schedule_fingerprint")
    if recorded is None:
        if warn:
            logger.warning(
                "%s records no schedule fingerprint: cannot check that it was trained on this data", checkpoint
            )
        return
    if recorded == fingerprint:
        return
    text = (
        f"{checkpoint} was trained on another schedule (fingerprint {recorded}; this run plans {fingerprint}): the "
        "dataset (its pairs' token lengths), seed / data_seed, or the batch layout (world size, "
        "per_device_train_batch_size, gradient_accumulation_steps) differ, so the resumed step would index other "
        "pairs than the original run's."
    )
    if not allow_mismatch:
        raise CheckpointError(
            "resume_data_mismatch",
            f"{text} Resume with the original data and layout, or set allow_resume_data_mismatch=True to continue "
            "from its weights and step with this run's schedule.",
        )
    if warn:
        logger.warning("%s Continuing as allow_resume_data_mismatch=True asks.", text)


SETTING_GROUPS = ("data", "objective")
"""The groups of recorded settings (``training/resume_settings.py``): a data change comes first in the refusal."""


def check_resumed_settings(
    checkpoint: str, settings: Mapping[str, Any] | None, *, allow_mismatch: bool, warn: bool = True
) -> None:
    """Refuses to resume ``checkpoint`` with other data settings or another objective than it was trained with.

    Args:
        checkpoint: The checkpoint to resume.
        settings: This run's ``{"data": {...}, "objective": {...}}`` (None: the caller records none; nothing checked).
        allow_mismatch: ``allow_resume_data_mismatch``: warn with every difference instead of refusing.
        warn: Log (the main process does).

    Raises:
        CheckpointError: ``resume_data_mismatch`` when a data setting differs (the tokenizer included), else
            ``resume_objective_mismatch`` when an objective setting differs; the message lists every difference.
    """
    if settings is None:
        return
    recorded = (read_manifest(checkpoint) or {}).get("resume_settings")
    if not isinstance(recorded, Mapping):
        if warn:
            logger.warning("%s records no run settings: cannot check its data limits, tokenizer and loss", checkpoint)
        return
    changed = {group: _differences(recorded, settings, group) for group in SETTING_GROUPS}
    changes = [change for group in SETTING_GROUPS for change in changed[group]]
    if not changes:
        return
    text = f"{checkpoint} was trained with other settings than this run's: {'; '.join(changes)}."
    if allow_mismatch:
        if warn:
            logger.warning("%s Continuing as allow_resume_data_mismatch=True asks.", text)
        return
    message = (
        f"{text} Its optimizer state and step belong to those pairs and that loss. Resume with the recorded values "
        "(or the recorded tokenizer), start a new run from its weights (--model_name_or_path <checkpoint>), or set "
        "allow_resume_data_mismatch=True to continue anyway. Options that may change on resume: docs/guide.md "
        "section 12."
    )
    if changed["data"]:
        raise CheckpointError("resume_data_mismatch", message)
    raise CheckpointError("resume_objective_mismatch", message)


def _differences(recorded: Mapping[str, Any], current: Mapping[str, Any], group: str) -> list[str]:
    """``"option: recorded -> current"`` for each option of ``group`` that differs (tokenizer digests shortened)."""
    before, after = recorded.get(group) or {}, current.get(group) or {}
    return [
        f"{name} {_shown(name, before.get(name))} -> {_shown(name, after.get(name))}"
        for name in sorted(set(before) | set(after))
        if before.get(name) != after.get(name)
    ]


def _shown(name: str, value: Any) -> str:
    if name == "tokenizer" and isinstance(value, str):
        return f"fingerprint {value[:12]}"
    return repr(value)
