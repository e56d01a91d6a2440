"""Whether a checkpoint may be resumed: its bytes are the ones saved, and none of its pickles can run code.

Resume loads a checkpoint with code that trusts it: DeepSpeed unpickles ``global_stepN/*.pt`` with
``torch.load(weights_only=False)``, and HF's Trainer loads whatever weights are there. :func:`verify_resume_checkpoint`
runs on every rank before any of that (``RunGuard`` calls it right after the checkpoint is resolved); the main process
alone reads the files, and every rank learns its verdict through the CPU group, so all raise the same error:

1. ``checkpoint_tampered``: a file listed in the manifest (``pair_dpo_checkpoint.json``) whose SHA-256 is not the
   recorded one, a manifest that records no SHA-256, or a file a loader would read that the manifest does not list
   (weights, pickles, anything in a subdirectory such as DeepSpeed's ``global_stepN/``, DeepSpeed's ``latest``).
2. ``checkpoint_unsafe_pickle``: a pickle-bearing file (``*.pt``, ``*.pth``, ``*.bin``, ``*.pkl``) referencing a global
   outside torch's ``weights_only`` set and ``integrity.pickles.ALLOWED_GLOBALS``. This also runs on a checkpoint
   without a manifest (another trainer's: every such file in it), and catches code in a pickle whose manifest was
   rewritten to vouch for it. ``training_args.bin`` is not loaded by a resume and is not scanned.

The reference identity (``pair_dpo_reference.json``) is not in the manifest: the reference gate judges it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from pair_dpo_trainer.errors import CheckpointError, SnapshotIntegrityError
from pair_dpo_trainer.fault_tolerance.checkpoint import MANIFEST_FILENAME, read_manifest
from pair_dpo_trainer.integrity import IDENTITY_FILENAME
from pair_dpo_trainer.integrity.hashing import HashJob, verify_hashes
from pair_dpo_trainer.integrity.pickles import pickle_problem
from pair_dpo_trainer.parallel.agreement import all_gather_cpu

logger = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")
"""Files that ``torch.load`` / ``pickle.load`` read on resume (HF Trainer, DeepSpeed, Accelerate)."""
LOADED_SUFFIXES = (*PICKLE_SUFFIXES, ".safetensors", ".npy", ".npz")
"""Files a loader reads on resume: one of these that the manifest does not list is refused."""
NOT_LOADED = frozenset({"training_args.bin"})
"""Pickles a resume never loads (the Trainer only writes them), so not scanned."""
_UNTRACKED = frozenset({MANIFEST_FILENAME, IDENTITY_FILENAME})
_FIX = (
    "Resume from another checkpoint (--resume_from_checkpoint <output_dir>/checkpoint-M), or start a new run; if "
    "the change was intended, start a new run from its weights (--model_name_or_path {path}) or delete its "
    f"{MANIFEST_FILENAME} to resume it as an unverified checkpoint (its pickles are still scanned)."
)

Verdict = tuple[str, str] | None
"""``(reason_code, message)`` of a refused checkpoint, or None."""


def verify_resume_checkpoint(checkpoint: str, *, is_main: bool) -> None:
    """Refuses to resume ``checkpoint`` unless it verifies; every rank calls it (a collective).

    Args:
        checkpoint: The resolved checkpoint directory.
        is_main: This is the main process (it alone reads the files).

    Raises:
        CheckpointError: ``checkpoint_tampered`` or ``checkpoint_unsafe_pickle``, on every rank.
    """
    verdict: Verdict = None
    if is_main:
        try:
            verdict = checkpoint_verdict(checkpoint)
        except Exception as exc:  # noqa: BLE001 - every rank must learn the outcome, a crash included
            verdict = ("checkpoint_tampered", f"{checkpoint} cannot be verified ({exc!r}). " + _fix(checkpoint))
    refused = all_gather_cpu(verdict)[0]
    if refused is not None:
        raise CheckpointError(*refused)


def checkpoint_verdict(checkpoint: str | os.PathLike[str]) -> Verdict:
    """Why ``checkpoint`` must not be resumed (see the module docstring), or None. Reads every listed file once."""
    path = Path(checkpoint)
    manifest = read_manifest(path)
    if manifest is None:
        names = [name for name in _files_on_disk(path) if name not in _UNTRACKED]
    else:
        problem = _tamper_problem(path, manifest)
        if problem is not None:
            return "checkpoint_tampered", f"resume_from_checkpoint={str(path)!r}: {problem}. " + _fix(path)
        names = list(manifest["files"])
    for name in sorted(names):
        if Path(name).suffix in PICKLE_SUFFIXES and name not in NOT_LOADED:
            problem = pickle_problem(path / name)
            if problem is not None:
                message = _unsafe_message(path, name, problem)
                return "checkpoint_unsafe_pickle", message
    return None


def _tamper_problem(path: Path, manifest: dict) -> str | None:
    files, digests = manifest["files"], manifest.get("sha256")
    if not isinstance(digests, dict) or set(digests) != set(files):
        return (
            f"its {MANIFEST_FILENAME} records no SHA-256 for every file (a manifest of an older pair_dpo_trainer, "
            "or an edited one), so its files cannot be verified"
        )
    escaping = sorted(name for name in files if Path(name).is_absolute() or ".." in Path(name).parts)
    if escaping:
        return f"its {MANIFEST_FILENAME} lists {escaping[0]}, a path outside the checkpoint"
    extra = sorted(name for name in _files_on_disk(path) if name not in files and _loaded(name))
    if extra:
        return f"{extra[0]} is not listed in its {MANIFEST_FILENAME}, and resume would load it"
    jobs = [
        HashJob(rel=name, path=path / name, kind="lfs", expected=str(digests[name]), size=int(files[name]))
        for name in files
    ]
    try:
        verify_hashes(jobs)
    except SnapshotIntegrityError as exc:
        if exc.reason_code == "hash_mismatch":
            return f"{exc.path} changed since it was saved: its SHA-256 is not the one recorded in {MANIFEST_FILENAME}"
        return f"{exc.path} cannot be read to verify it ({exc.reason_code})"
    return None


def _files_on_disk(path: Path) -> list[str]:
    """Every file and symlink under ``path`` (relative names)."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_symlink() or not p.is_dir())


def _loaded(name: str) -> bool:
    """A file some loader reads on resume: weights or a pickle, anything in a subdirectory, DeepSpeed's tag file."""
    rel = Path(name)
    return rel.suffix in LOADED_SUFFIXES or len(rel.parts) > 1 or rel.name == "latest"


def _unsafe_message(path: Path, name: str, problem: str) -> str:
    return (
        f"resume_from_checkpoint={str(path)!r}: {name} {problem}; unpickling it could run code (DeepSpeed loads its "
        "files with torch.load(weights_only=False)), so nothing of this checkpoint is loaded. Do not resume it: "
        "resume from another checkpoint (--resume_from_checkpoint <output_dir>/checkpoint-M) or start a new run, "
        "and find out who wrote into this directory."
    )


def _fix(path: str | os.PathLike[str]) -> str:
    return _FIX.format(path=path)
