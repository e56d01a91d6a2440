"""Atomic checkpoints: a ``checkpoint-N`` directory appears under its final name only when it is complete.

HF ``Trainer._save_checkpoint`` (the same code in transformers 5.17 and 5.24) writes straight into
``<output_dir>/checkpoint-N`` and then deletes old checkpoints beyond ``save_total_limit`` with
``shutil.rmtree(ignore_errors=True)``: a kill or a full disk in between left an empty directory, a 0-byte
``optimizer.pt`` or a half-deleted old checkpoint, all under names that resume picks. Here the same Trainer code
writes into ``<output_dir>/.pair_dpo_staging/checkpoint-N`` instead (its ``_get_output_dir`` is pointed there for the
duration of the save; every rank writes its own files, DeepSpeed ZeRO-3 shards and RNG states included), then:

Details: fault_tolerance/README.md, "Module notes", ``checkpoint.py``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from pair_dpo_trainer.atomic import atomic_open, disk_full, disk_space, fsync_dir, fsync_tree, read_regular, space_text
from pair_dpo_trainer.errors import CheckpointError, PairDPOError
from pair_dpo_trainer.fault_tolerance.checkpoint_paths import safe_name
from pair_dpo_trainer.integrity import IDENTITY_FILENAME, write_identity
from pair_dpo_trainer.integrity.hashing import sha256_files
from pair_dpo_trainer.parallel.agreement import all_gather_cpu

logger = logging.getLogger(__name__)

MANIFEST_FILENAME = "pair_dpo_checkpoint.json"
MANIFEST_FORMAT = 2
MANIFEST_MAX_BYTES = 16 * 2**20
"""A manifest larger than this is refused unread (one per file: ~100 bytes each, 100k files fit)."""
STAGING_DIRNAME = ".pair_dpo_staging"
TRASH_PREFIX = ".pair_dpo_trash-"
ABANDONED_PREFIX = "abandoned-"
"""Newer checkpoints moved aside by an explicit resume of an older one: ``abandoned-checkpoint-N-<UTC time>``."""


@dataclass(frozen=True)
class SaveRequest:
    """What one atomic save needs besides the Trainer.

    Attributes:
        identity: The reference identity to write inside (None when reference-free).
        schedule_fingerprint: The train schedule's fingerprint (``PairBatchSampler.schedule_fingerprint(0)``).
        settings: The run's data and objective settings, compared on resume (``resume.check_resumed_settings``).
        protect: Checkpoints rotation must keep besides the new one and the best one (the resumed checkpoint until
            a newer one of its line exists).
        nonfinite_grad_skips: The optimizer steps of the run skipped so far for a non-finite gradient norm
            (``training/nonfinite.py``); a resume continues the count.
    """

    identity: Any
    schedule_fingerprint: str | None
    settings: Any = None
    protect: tuple[Any, ...] = ()
    nonfinite_grad_skips: int = 0


def staging_root(run_dir: str | os.PathLike[str]) -> Path:
    """Where checkpoints are written before they become visible (inside ``run_dir``: the same filesystem)."""
    return Path(run_dir) / STAGING_DIRNAME


def checkpoint_step(path: Path) -> int | None:
    """``N`` of a ``checkpoint-N`` directory name, else None."""
    prefix = f"{PREFIX_CHECKPOINT_DIR}-"
    tail = path.name[len(prefix) :] if path.name.startswith(prefix) else ""
    return int(tail) if tail.isdigit() else None


def list_checkpoints(run_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """The visible ``checkpoint-N`` directories of ``run_dir``, by step (ascending)."""
    root = Path(run_dir)
    if not root.is_dir():
        return []
    found = [(checkpoint_step(p), p) for p in root.iterdir() if p.is_dir()]
    return sorted((step, path) for step, path in found if step is not None)


def read_manifest(checkpoint: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The checkpoint's manifest (its names normalised), or None when it has none or one :func:`manifest_problem`
    refuses."""
    return load_manifest(checkpoint)[0]


def load_manifest(checkpoint: str | os.PathLike[str]) -> tuple[dict[str, Any] | None, str | None]:
    """``(manifest, None)``, ``(None, None)`` when the checkpoint has no manifest, or ``(None, why)`` for one that
    must not be trusted: larger than :data:`MANIFEST_MAX_BYTES`, not a regular file (a FIFO is never opened for a
    blocking read), not JSON, a key given twice, or a name that is not a plain relative path or that aliases another
    (``./x`` and ``x``: every name is normalised, so a file is listed and hashed once)."""
    path = Path(checkpoint) / MANIFEST_FILENAME
    try:
        raw = read_regular(path, limit=MANIFEST_MAX_BYTES)
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as exc:
        return None, f"its {MANIFEST_FILENAME} cannot be read ({exc})"
    try:
        data = json.loads(raw, object_pairs_hook=_unique_keys)
    except ValueError as exc:
        return None, f"its {MANIFEST_FILENAME} is not valid JSON ({exc})"
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        return None, f"its {MANIFEST_FILENAME} lists no files"
    try:
        data["files"] = _normalised(data["files"], "files")
        if isinstance(data.get("sha256"), dict):
            data["sha256"] = _normalised(data["sha256"], "sha256")
    except ValueError as exc:
        return None, f"its {MANIFEST_FILENAME} {exc}"
    return data, None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        raise ValueError(f"the key {twice[0]!r} is given twice in one object")
    return dict(pairs)


def _normalised(entries: dict[str, Any], what: str) -> dict[str, Any]:
    """``entries`` keyed by normalised names; a name outside the checkpoint or two aliases of one name refused."""
    result: dict[str, Any] = {}
    for name, value in entries.items():
        normal = safe_name(name)
        if normal is None:
            raise ValueError(f"lists {name[:200]!r} in {what!r}, a path outside the checkpoint")
        if normal in result:
            raise ValueError(f"lists {normal!r} twice in {what!r} (as aliases such as './{normal}')")
        result[normal] = value
    return result


def recorded_nonfinite_grad_skips(checkpoint: str | os.PathLike[str] | None) -> int:
    """The count of skipped non-finite steps ``checkpoint`` records (0: none recorded, or no checkpoint)."""
    value = (read_manifest(checkpoint) or {}).get("nonfinite_grad_skips") if checkpoint is not None else None
    return value if isinstance(value, int) and value >= 0 else 0


def checkpoint_problem(checkpoint: str | os.PathLike[str]) -> str | None:
    """Why ``checkpoint`` is not a complete checkpoint, or None when it is one."""
    path = Path(checkpoint)
    if not path.is_dir():
        return "no such directory"
    manifest, refused = load_manifest(path)
    if refused is not None:
        return refused
    if manifest is None:
        return (
            f"no readable {MANIFEST_FILENAME} (an interrupted save, a save by an older pair_dpo_trainer, or another "
            "trainer's checkpoint)"
        )
    if manifest.get("weights_finite") is False:
        return "its manifest records weights that are not finite"
    for name, size in manifest["files"].items():
        try:
            actual = (path / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, the manifest recorded {size}"
    return None


def save_checkpoint_atomically(trainer: Any, trial: Any, write: Callable[[], None], request: SaveRequest) -> Path:
    """Runs the Trainer's own save (``write``) into a staged directory and publishes it complete; every rank calls it.

    Args:
        trainer: The ``PairDPOTrainer``.
        trial: The hyper-parameter search trial (as ``Trainer._save_checkpoint`` receives it).
        write: ``Trainer._save_checkpoint`` bound to ``(model, trial)``.
        request: The identity and schedule fingerprint to record.

    Returns:
        The published ``checkpoint-N`` directory.

    Raises:
        CheckpointError: ``nonfinite_weights`` (a weight of some rank is NaN/inf: nothing is written),
            ``disk_full`` (the filesystem of ``output_dir`` filled up) or ``save_failed`` (another rank failed: its
            error is in its log); any other error of the failing rank itself. Nothing partial is visible.
    """
    args = trainer.args
    run_dir = Path(trainer._get_output_dir(trial=trial))
    name = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    check_weights_finite(trainer.model, name)
    staged, final = staging_root(run_dir) / name, run_dir / name
    stages: list[tuple[str, Callable[[], None], bool]] = [
        ("write", lambda: _write_staged(trainer, trial, write, staged, final, request), True),
        ("sync", lambda: fsync_tree(staged), args.local_process_index == 0),
        ("publish", lambda: _publish(staged, final, request, trainer), bool(args.should_save)),
    ]
    for stage, action, runs_here in stages:
        error = _attempt(action, run_dir, name) if runs_here else None
        _agree(error, stage=stage, name=name, rank=args.process_index, cleanup=staged if args.should_save else None)
    if args.should_save:
        logger.info("checkpoint %s complete (%d files)", final, len((read_manifest(final) or {"files": {}})["files"]))
    return final


def _write_staged(trainer: Any, trial: Any, write: Callable[[], None], staged: Path, final: Path, request) -> None:
    with _output_dir_redirected(trainer, staged.parent):
        write()
    state = trainer.state
    if state.best_model_checkpoint is not None and Path(state.best_model_checkpoint) == staged:
        state.best_model_checkpoint = str(final)  # HF recorded the staged path of a best checkpoint
        if trainer.args.should_save:
            from transformers.trainer import TRAINER_STATE_NAME

            state.save_to_json(str(staged / TRAINER_STATE_NAME))
    if trainer.args.should_save and request.identity is not None:
        write_identity(staged, request.identity)


@contextlib.contextmanager
def _output_dir_redirected(trainer: Any, root: Path) -> Iterator[None]:
    """Points ``trainer._get_output_dir`` at ``root`` (HF's save then writes ``root/checkpoint-N`` and rotates the
    staging root, which holds nothing else) for the duration of one save."""
    root.mkdir(parents=True, exist_ok=True)
    trainer._get_output_dir = lambda trial=None: str(root)
    try:
        yield
    finally:
        del trainer._get_output_dir


def _publish(staged: Path, final: Path, request: SaveRequest, trainer: Any) -> None:
    """Manifest (every file's size and SHA-256), rename, fsync, then rotation (main process only)."""
    files = {
        str(path.relative_to(staged)): path.stat().st_size
        for path in sorted(staged.rglob("*"))
        if path.is_file() and not path.is_symlink() and path.name != IDENTITY_FILENAME
    }
    manifest = {
        "sha256": sha256_files(staged, list(files)),  # what resume verifies before it loads anything
        "format": MANIFEST_FORMAT,
        "step": trainer.state.global_step,
        "world_size": trainer.args.world_size,
        "reference_identity": None if request.identity is None else IDENTITY_FILENAME,
        "schedule_fingerprint": request.schedule_fingerprint,
        "resume_settings": request.settings,
        "weights_finite": True,  # check_weights_finite ran on every rank before the write
        "nonfinite_grad_skips": request.nonfinite_grad_skips,
        "files": files,
    }
    with atomic_open(staged / MANIFEST_FILENAME) as f:
        f.write(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    fsync_dir(staged)
    trash = None
    if final.exists():  # the same step saved twice (e.g. a step and an epoch save): replace the older copy
        trash = final.with_name(f"{TRASH_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}")
        os.rename(final, trash)
    os.rename(staged, final)
    fsync_dir(final.parent)
    with contextlib.suppress(OSError):
        staged.parent.rmdir()  # the staging directory exists only while a save is in flight
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    keep = (final, trainer.state.best_model_checkpoint, *request.protect)
    rotate_checkpoints(final.parent, trainer.args.save_total_limit, keep=keep)


def rotate_checkpoints(run_dir: Path, limit: int | None, *, keep: tuple[Any, ...]) -> list[Path]:
    """Deletes the oldest complete checkpoints beyond ``limit`` (never one in ``keep``); returns the deleted ones.

    Incomplete directories are left alone (resume skips them with a warning). Each deleted checkpoint is first
    renamed to a hidden trash name, so an interrupted deletion never leaves a half-deleted ``checkpoint-N``.
    """
    if not limit or limit <= 0:
        return []
    protected = {Path(p).resolve() for p in keep if p is not None}
    complete = [path for _, path in list_checkpoints(run_dir) if checkpoint_problem(path) is None]
    budget = max(limit, len(protected))
    deleted: list[Path] = []
    for path in complete:
        if len(complete) - len(deleted) <= budget:
            break
        if path.resolve() in protected:
            continue
        trash = path.with_name(f"{TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}")
        os.rename(path, trash)
        fsync_dir(run_dir)
        shutil.rmtree(trash, ignore_errors=True)
        deleted.append(path)
    return deleted


def check_weights_finite(model: torch.nn.Module, name: str) -> None:
    """Refuses to save ``name`` unless every weight of every rank is finite (one reduction and one host read per rank
    per save, then one CPU all-gather). Every rank calls it.

    Raises:
        CheckpointError: ``nonfinite_weights`` on every rank.
    """
    finite = bool(local_weights_finite(model.parameters()))
    bad_ranks = [rank for rank, ok in enumerate(all_gather_cpu(finite)) if not ok]
    if not bad_ranks:
        return
    raise CheckpointError(
        "nonfinite_weights",
        f"{name} was not saved: the weights held by rank(s) {bad_ranks} contain NaN/inf (the training diverged), and "
        "a checkpoint of them could never be resumed. The earlier checkpoints are intact: resume the last one "
        "(--resume_from_checkpoint latest) with a lower learning_rate, a max_grad_norm or a warmup.",
    )


def local_weights_finite(parameters: Any) -> torch.Tensor:
    """Whether every parameter this rank holds is finite: a 0-d bool tensor (device ops only, no host read).

    A ZeRO-3 parameter is read through its local partition (``ds_tensor``), an FSDP2 DTensor through its local shard:
    each rank checks what it holds and nothing is gathered.
    """
    flags = [torch.isfinite(_held(p)).all() for p in parameters]
    if not flags:
        return torch.tensor(True)
    return torch.stack([flag.to(flags[0].device) for flag in flags]).all()


def _held(parameter: torch.Tensor) -> torch.Tensor:
    partition = getattr(parameter, "ds_tensor", None)
    if partition is not None:
        return partition
    to_local = getattr(parameter, "to_local", None)
    return to_local() if callable(to_local) else parameter.detach()


def move_aside(paths: list[Path]) -> list[Path]:
    """Renames each checkpoint to ``abandoned-checkpoint-N-<UTC time>`` beside it (``latest`` / ``auto`` and rotation
    see only ``checkpoint-N`` names; nothing is deleted); returns the new paths. Main process only."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    moved = []
    for path in paths:
        target = path.with_name(f"{ABANDONED_PREFIX}{path.name}-{stamp}")
        os.rename(path, target)
        moved.append(target)
    if moved:
        fsync_dir(moved[0].parent)
    return moved


def clear_leftovers(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Removes staged saves and trash of earlier (interrupted) runs; returns what was removed. Main process only,
    while holding the output-dir lock (no other run writes there)."""
    root = Path(run_dir)
    if not root.is_dir():
        return []
    leftovers = [p for p in root.iterdir() if p.name == STAGING_DIRNAME or p.name.startswith(TRASH_PREFIX)]
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    return leftovers


def staged_leftovers(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Checkpoints an interrupted save left in the staging directory (never visible, never resumed)."""
    root = staging_root(run_dir)
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def _attempt(action: Callable[[], None], run_dir: Path, name: str) -> PairDPOError | BaseException | None:
    """Runs one stage; returns its error (a full disk as ``disk_full``) instead of raising, so ranks can agree."""
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - every failure is agreed on, then raised on every rank
        full = disk_full_error(exc, run_dir, name)
        if full is not None:
            full.__cause__ = exc
            logger.error("%s", full)
            return full
        logger.error("saving %s failed on this rank: %r", name, exc)
        return exc
    return None


def _agree(error: BaseException | None, *, stage: str, name: str, rank: int, cleanup: Path | None) -> None:
    """Every rank learns whether any rank failed ``stage``; on a failure every rank raises (the staged directory is
    removed by the main process first)."""
    summary = None if error is None else (getattr(error, "reason_code", "save_failed"), str(error)[:2000])
    try:
        outcomes = all_gather_cpu(summary)
    except RuntimeError:
        if error is not None:  # the collective failed too: this rank's own error is the one to report
            raise error from None
        raise
    failed = [(r, outcome) for r, outcome in enumerate(outcomes) if outcome is not None]
    if not failed:
        return
    if cleanup is not None:
        shutil.rmtree(cleanup, ignore_errors=True)
        with contextlib.suppress(OSError):
            cleanup.parent.rmdir()  # the staging directory exists only while a save is in flight (never left empty)
    if error is not None:
        raise error
    first_rank, (code, text) = failed[0]
    raise CheckpointError(
        code if code == "disk_full" else "save_failed",
        f"{name} was not saved: rank {first_rank} failed during the {stage} stage ({text}); nothing partial is "
        "visible and the earlier checkpoints are intact.",
    )


def disk_full_error(exc: BaseException, run_dir: Path, name: str) -> CheckpointError | None:
    """``disk_full`` for an error caused by a full filesystem (or quota) under ``run_dir``, else None
    (:func:`pair_dpo_trainer.atomic.disk_full` tells which errors are)."""
    if not disk_full(exc, run_dir):
        return None
    free, _ = disk_space(run_dir)
    error = CheckpointError(
        "disk_full",
        f"no space left on the filesystem of {run_dir} while writing {name} ({space_text(run_dir)}): the partial "
        f"{name} was removed and the earlier checkpoints are intact. Free space there (or lower save_total_limit, or "
        "set output_dir on a larger disk), then resume with --resume_from_checkpoint latest.",
    )
    error.directory, error.free_bytes = str(run_dir), free
    return error
