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
   rewritten to vouch for it. ``training_args.bin`` is not loaded by a resume and is not scanned. A DCP ``.metadata``
   (FSDP2's sharded checkpoints, a raw pickle) may reference only its own data classes and names only shard files
   inside its directory (``integrity.pickles.dcp_metadata_problem``).
3. ``checkpoint_unsafe_path``: a symlink anywhere in the checkpoint, a DeepSpeed tag (``latest``) that is not one
   plain directory name of the checkpoint, or a weight index naming a shard outside it
   (``checkpoint_paths.py``); ``checkpoint_special_file``: a FIFO, socket or device in it (found by ``lstat``, never
   opened, so the scan cannot hang); ``checkpoint_incomplete``: a tag naming no directory, or ``global_step*``
   without ``latest``. These run first, with or without a manifest.

What is scanned is what is loaded: the walk follows no link, every name a loader joins to the checkpoint is a plain
name inside it, and DeepSpeed is handed the scanned tag (:func:`deepspeed_loads_tag`) instead of reading ``latest``
again.

The reference identity (``pair_dpo_reference.json``) is not in the manifest: the reference gate judges it.

Details: fault_tolerance/README.md, "Module notes", ``checkpoint_trust.py``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pair_dpo_trainer.errors import CheckpointError, SnapshotIntegrityError
from pair_dpo_trainer.fault_tolerance.checkpoint import MANIFEST_FILENAME, load_manifest
from pair_dpo_trainer.fault_tolerance.checkpoint_paths import (
    RefusedError,
    Tree,
    deepspeed_tag,
    index_problem,
    scan_tree,
)
from pair_dpo_trainer.integrity import IDENTITY_FILENAME
from pair_dpo_trainer.integrity.hashing import HashJob, verify_hashes
from pair_dpo_trainer.integrity.pickles import dcp_metadata_problem, pickle_problem
from pair_dpo_trainer.parallel.agreement import all_gather_cpu

logger = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")
"""Files that ``torch.load`` / ``pickle.load`` read on resume (HF Trainer, DeepSpeed, Accelerate)."""
LOADED_SUFFIXES = (*PICKLE_SUFFIXES, ".safetensors", ".npy", ".npz")
"""Files a loader reads on resume: one of these that the manifest does not list is refused."""
DCP_METADATA_NAME = ".metadata"
"""The index of a torch distributed checkpoint (FSDP2 ``SHARDED_STATE_DICT``), a raw pickle its reader unpickles."""
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


def verify_resume_checkpoint(checkpoint: str, *, is_main: bool) -> str | None:
    """Refuses to resume ``checkpoint`` unless it verifies; every rank calls it (a collective).

    Args:
        checkpoint: The resolved checkpoint directory.
        is_main: This is the main process (it alone reads the files).

    Returns:
        The DeepSpeed tag that was scanned (hand it to :func:`deepspeed_loads_tag`), or None (no DeepSpeed files).

    Raises:
        CheckpointError: ``checkpoint_tampered``, ``checkpoint_unsafe_pickle``, ``checkpoint_unsafe_path``,
            ``checkpoint_special_file`` or ``checkpoint_incomplete``, on every rank.
    """
    outcome: tuple[Verdict, str | None] = (None, None)
    if is_main:
        try:
            outcome = inspect_checkpoint(checkpoint)
        except Exception as exc:  # noqa: BLE001 - every rank must learn the outcome, a crash included
            text = f"{checkpoint} cannot be verified ({exc!r}). " + _fix(checkpoint)
            outcome = (("checkpoint_tampered", text), None)
    refused, tag = all_gather_cpu(outcome)[0]
    if refused is not None:
        raise CheckpointError(*refused)
    return tag


def checkpoint_verdict(checkpoint: str | os.PathLike[str]) -> Verdict:
    """Why ``checkpoint`` must not be resumed (see the module docstring), or None. Reads every listed file once."""
    return inspect_checkpoint(checkpoint)[0]


def inspect_checkpoint(checkpoint: str | os.PathLike[str]) -> tuple[Verdict, str | None]:
    """``(verdict, DeepSpeed tag)`` of ``checkpoint``: the verdict as :func:`checkpoint_verdict`, the tag that
    DeepSpeed is to load (None: no DeepSpeed files, or refused)."""
    path = Path(checkpoint)
    try:
        tree = scan_tree(path)  # by lstat, before any file of it is opened
        tag = deepspeed_tag(path, tree)
        manifest, problem = load_manifest(path)
        if problem is None and manifest is not None:
            problem = _tamper_problem(path, manifest, tree)
        if problem is not None:
            raise RefusedError("checkpoint_tampered", problem)
        problem = index_problem(path, tree)
        if problem is not None:
            raise RefusedError("checkpoint_unsafe_path", problem)
    except RefusedError as refusal:
        return (refusal.reason_code, f"resume_from_checkpoint={str(path)!r}: {refusal.text}. " + _fix(path)), None
    names = tree.files if manifest is None else list(manifest["files"])
    for name in sorted(names):
        problem = _pickle_problem(path, name)
        if problem is not None:
            message = _unsafe_message(path, name, problem)
            return ("checkpoint_unsafe_pickle", message), None
    return None, tag


def _pickle_problem(path: Path, name: str) -> str | None:
    """Why loading ``name`` could run code (a ``torch.save`` pickle, or a DCP ``.metadata``), else None."""
    if Path(name).name == DCP_METADATA_NAME:
        return dcp_metadata_problem(path / name)
    if Path(name).suffix in PICKLE_SUFFIXES and name not in NOT_LOADED:
        return pickle_problem(path / name)
    return None


def _tamper_problem(path: Path, manifest: dict, tree: Tree) -> str | None:
    files, digests = manifest["files"], manifest.get("sha256")
    if not isinstance(digests, dict) or set(digests) != set(files):
        return (
            f"its {MANIFEST_FILENAME} records no SHA-256 for every file (a manifest of an older pair_dpo_trainer, "
            "or an edited one), so its files cannot be verified"
        )
    extra = sorted(name for name in tree.files if name not in files and name not in _UNTRACKED and _loaded(name))
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


@contextlib.contextmanager
def deepspeed_loads_tag(checkpoint: str | None, tag: str | None) -> Iterator[None]:
    """While open, ``DeepSpeedEngine.load_checkpoint`` of ``checkpoint`` loads the scanned ``tag``.

    HF's Trainer resumes a DeepSpeed engine with ``engine.load_checkpoint(checkpoint)`` (``tag=None``), and DeepSpeed
    then reads the tag from ``<checkpoint>/latest`` itself: a file that could change between the scan and the load.
    Here the call gets ``tag=<the scanned tag>`` instead, so ``latest`` is not read again; a call naming another tag
    for this checkpoint is refused. Loads of other directories (``load_best_model_at_end``: this run's own
    checkpoints) pass through unchanged. Nothing is patched when the checkpoint has no DeepSpeed tag.

    Raises:
        CheckpointError: ``checkpoint_unsafe_path``, from inside the load, for a call naming another tag.
    """
    if checkpoint is None or tag is None or importlib.util.find_spec("deepspeed") is None:
        yield
        return
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine.load_checkpoint
    scanned = os.path.realpath(checkpoint)

    @functools.wraps(original)
    def load_checkpoint(engine: Any, load_dir: str, tag_given: Any = None, *args: Any, **kwargs: Any) -> Any:
        if "tag" in kwargs:
            tag_given = kwargs.pop("tag")
        if os.path.realpath(load_dir) == scanned:
            if tag_given is not None and str(tag_given) != tag:
                raise CheckpointError(
                    "checkpoint_unsafe_path",
                    f"DeepSpeed was asked to load the tag {tag_given!r} of {checkpoint}, but the tag scanned before "
                    f"resume is {tag!r}; nothing else of it is loaded.",
                )
            tag_given = tag
        return original(engine, load_dir, tag_given, *args, **kwargs)

    DeepSpeedEngine.load_checkpoint = load_checkpoint
    try:
        yield
    finally:
        DeepSpeedEngine.load_checkpoint = original
