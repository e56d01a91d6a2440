"""One hashing of the reference snapshot per node: the local main proves it, the node's other ranks check the proof.

Hashing a 70B snapshot reads ~140 GB; every rank of a node doing it reads the same bytes eight times. Instead
(:func:`pair_dpo_trainer.reference.source.resolve_reference_source` through
:class:`~pair_dpo_trainer.parallel.node.Node`):

Details: integrity/README.md, "Module notes", ``proof.py``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from pair_dpo_trainer.integrity.hashing import ProgressFn, verify_hashes
from pair_dpo_trainer.integrity.snapshot import SnapshotPlan, VerifiedSnapshot, plan_snapshot

PROOF_FORMAT = 1
RACY_SECONDS = 2.0
"""A file changed less than this long before the proof was made is not proven (hashed by every rank)."""


@dataclass(frozen=True)
class FileStamp:
    """What changes when a file's bytes, or the file itself, change."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: str | os.PathLike[str]) -> FileStamp | None:
        """The stamp of ``path`` now (None when it cannot be read)."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def settled_stamp(path: str | os.PathLike[str], before: FileStamp | None, size: int) -> FileStamp | None:
    """The stamp of a file just hashed, when a digest of it proves something to another process; else None.

    Args:
        path: The file.
        before: Its stamp taken before it was hashed.
        size: The bytes the hashing read.

    Returns:
        The file's current stamp, when it equals ``before``, has ``size`` bytes and last changed more than
        :data:`RACY_SECONDS` ago (a write within that window may leave the stamp as it was); None when the file
        changed while it was hashed or too recently.
    """
    after = FileStamp.of(path)
    if after is None or after != before or after.size != size:
        return None  # changed while it was hashed
    if max(after.mtime_ns, after.ctime_ns) > time.time_ns() - int(RACY_SECONDS * 1e9):
        return None  # too recent to tell a later write apart
    return after


@dataclass(frozen=True)
class ProvenFile:
    """One file the local main hashed: repository path, resolved path, digest kind, digest and stamp."""

    rel: str
    path: str
    kind: str
    digest: str
    stamp: FileStamp


@dataclass(frozen=True)
class SnapshotProof:
    """The local main's hashing of one snapshot (see the module docstring).

    Attributes:
        root: The resolved snapshot directory.
        revision: The pinned commit it was verified against.
        manifest_digest: The verified snapshot's manifest digest.
        files: The proven files (files that changed during or just before hashing are not in it).
        format: :data:`PROOF_FORMAT`.
    """

    root: str
    revision: str
    manifest_digest: str
    files: tuple[ProvenFile, ...]
    format: int = PROOF_FORMAT


def verify_and_prove(
    path: str | os.PathLike[str],
    revision: str,
    *,
    threads: int | None = None,
    allow_pickle: bool = False,
    progress: ProgressFn | None = None,
) -> tuple[VerifiedSnapshot, SnapshotProof]:
    """``verify_snapshot`` (every check, every file hashed) and the proof of it for the node's other ranks.

    Raises:
        SnapshotIntegrityError: The reason codes of ``verify_snapshot``.
    """
    plan = plan_snapshot(path, revision, allow_pickle=allow_pickle)
    before = [FileStamp.of(job.path) for job in plan.jobs]
    snapshot = plan.verified(verify_hashes(list(plan.jobs), threads=threads, progress=progress))
    proven = []
    for job, file, stamp in zip(plan.jobs, snapshot.files, before, strict=True):
        after = settled_stamp(job.path, stamp, file.size)
        if after is not None:
            proven.append(ProvenFile(job.rel, str(job.path), job.kind, file.digest, after))
    proof = SnapshotProof(str(plan.root), plan.revision, snapshot.manifest_digest, tuple(proven))
    return snapshot, proof


def verify_with_proof(
    path: str | os.PathLike[str],
    revision: str,
    proof: SnapshotProof | None,
    *,
    threads: int | None = None,
    allow_pickle: bool = False,
    progress: ProgressFn | None = None,
) -> tuple[VerifiedSnapshot, int]:
    """Every check of ``verify_snapshot``; hashes only the files ``proof`` does not prove (module docstring).

    Returns:
        The verified snapshot and the number of files this call hashed.

    Raises:
        SnapshotIntegrityError: The reason codes of ``verify_snapshot`` (``hash_mismatch`` for a file the proof does
            not cover and whose bytes do not match).
    """
    plan = plan_snapshot(path, revision, allow_pickle=allow_pickle)
    trusted = _trusted(plan, proof)
    todo = [job for job in plan.jobs if job.rel not in trusted]
    hashed = dict(zip((job.rel for job in todo), verify_hashes(todo, threads=threads, progress=progress), strict=True))
    results = [trusted[job.rel] if job.rel in trusted else hashed[job.rel] for job in plan.jobs]
    return plan.verified(results), len(todo)


def _trusted(plan: SnapshotPlan, proof: SnapshotProof | None) -> dict[str, tuple[str, int]]:
    """``rel -> (digest, size)`` of the files the proof proves for this plan."""
    if proof is None or proof.format != PROOF_FORMAT or proof.revision != plan.revision:
        return {}
    if Path(proof.root) != plan.root:
        return {}
    by_rel = {file.rel: file for file in proof.files}
    trusted = {}
    for job in plan.jobs:
        file = by_rel.get(job.rel)
        if file is None or (file.path, file.kind, file.digest) != (str(job.path), job.kind, job.expected):
            continue
        if FileStamp.of(job.path) == file.stamp:
            trusted[job.rel] = (file.digest, file.stamp.size)
    return trusted
