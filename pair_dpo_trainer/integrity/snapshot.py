"""``verify_snapshot``: prove a local reference directory is exactly a pinned Hub commit, offline.

Check order (cheap first, hashing last, weights never loaded):

1. ``revision_not_pinned``: the revision is a full 40-hex lowercase commit.
2. ``not_a_directory``.
3. Paths: payload walk and metadata walk (``unsafe_path`` for escaping symlinks, unsafe names, special files).
4. Metadata: ``metadata_malformed``, then ``revision_mismatch``, then ``metadata_missing`` (payload file
   without metadata), then ``file_missing`` (metadata without payload file).
5. Completeness: ``missing_config``, ``no_weights``, ``pickle_weights``, index checks (``malformed_index``,
   ``empty_weight_map``, ``unsafe_path``, ``bad_suffix``, ``missing_shard``), then ``bad_weights``: each
   ``*.safetensors`` weight file's header parsed (``integrity/weights.py``; no tensor read).
6. Hashing of every payload file against its etag (``hash_mismatch``), streamed and in parallel threads.

Within a step, files are checked in sorted path order, so the reported path is deterministic.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from pair_dpo_trainer.errors import SnapshotIntegrityError
from pair_dpo_trainer.integrity.completeness import check_completeness
from pair_dpo_trainer.integrity.hashing import KIND_BY_ETAG_LENGTH, HashJob, ProgressFn, verify_hashes
from pair_dpo_trainer.integrity.layout import (
    FileMetadata,
    is_pinned_revision,
    parse_metadata,
    resolve_inside,
    scan_metadata,
    scan_payload,
)
from pair_dpo_trainer.integrity.weights import check_weight_headers


@dataclass(frozen=True)
class VerifiedFile:
    """One payload file whose bytes hash to its etag.

    Attributes:
        path: Repository path (``/``-separated, relative to the snapshot root).
        size: Bytes hashed.
        kind: ``"git"`` (Git blob SHA-1 etag) or ``"lfs"`` (SHA-256 etag).
        digest: The verified lowercase hex digest (equal to the etag).
    """

    path: str
    size: int
    kind: str
    digest: str


@dataclass(frozen=True)
class VerifiedSnapshot:
    """A snapshot directory proven to be exactly ``revision``.

    Attributes:
        root: Resolved snapshot directory.
        revision: The pinned 40-hex commit.
        files: Every payload file, sorted by path.
        manifest_digest: ``manifest_digest(files)``.
        weight_files: The weight files a loader would read (single file and/or shards), sorted.
    """

    root: Path
    revision: str
    files: tuple[VerifiedFile, ...]
    manifest_digest: str
    weight_files: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        """Sum of the verified file sizes."""
        return sum(f.size for f in self.files)

    @property
    def digests(self) -> dict[str, str]:
        """Mapping from repository path to verified digest."""
        return {f.path: f.digest for f in self.files}


def manifest_digest(files: tuple[VerifiedFile, ...] | list[VerifiedFile]) -> str:
    """SHA-256 over the canonical listing of ``(path, kind, digest, size)``.

    The listing is ``json.dumps(sorted([[path, kind, digest, size], ...]), separators=(",", ":"),
    ensure_ascii=False)`` encoded as UTF-8 (sorted by path).

    Args:
        files: Verified files, in any order.

    Returns:
        Lowercase hex SHA-256.
    """
    return hashlib.sha256(manifest_listing(files)).hexdigest()


def manifest_listing(files: tuple[VerifiedFile, ...] | list[VerifiedFile]) -> bytes:
    """The canonical listing that :func:`manifest_digest` hashes (UTF-8 JSON, sorted by path)."""
    listing = sorted([f.path, f.kind, f.digest, f.size] for f in files)
    return json.dumps(listing, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _require_pinned(revision: str) -> None:
    if not is_pinned_revision(revision):
        raise SnapshotIntegrityError(
            "revision_not_pinned",
            f"revision {revision!r} is not a full 40-hex lowercase commit hash (branches, tags and short "
            "SHAs are refused)",
        )


def open_root(path: str | os.PathLike[str]) -> Path:
    """Returns the resolved snapshot root or raises ``not_a_directory``."""
    candidate = Path(path)
    if not candidate.is_dir():
        state = "does not exist" if not candidate.exists() else "is not a directory"
        raise SnapshotIntegrityError("not_a_directory", f"snapshot path {str(candidate)!r} {state}")
    return Path(os.path.realpath(candidate))


def _read_records(root: Path, revision: str) -> dict[str, FileMetadata]:
    """Parses every metadata file, then checks each names ``revision``."""
    located = scan_metadata(root)
    records = {rel: parse_metadata(rel, located[rel]) for rel in sorted(located)}
    for rel, record in records.items():
        if record.commit != revision:
            raise SnapshotIntegrityError(
                "revision_mismatch", f"metadata names commit {record.commit}, expected {revision}", rel
            )
    return records


def _match_payload(root: Path, payload: dict[str, Path], records: dict[str, FileMetadata]) -> dict[str, Path]:
    """Pairs payload files with metadata records; returns the resolved path of every recorded file."""
    for rel in sorted(payload):
        if rel not in records:
            raise SnapshotIntegrityError(
                "metadata_missing", "payload file has no .cache/huggingface/download/*.metadata record", rel
            )
    matched: dict[str, Path] = {}
    for rel in sorted(records):
        real = payload.get(rel)
        if real is None:
            # Not found by the walk: it may be reachable through an in-snapshot directory symlink.
            real = resolve_inside(root, rel, what=f"metadata-named path {rel!r}")
            if not real.is_file():
                raise SnapshotIntegrityError("file_missing", "metadata exists but the file is not there", rel)
        matched[rel] = real
    return matched


@dataclass(frozen=True)
class SnapshotPlan:
    """A snapshot that passed every check but hashing (steps 1 to 5 of the module docstring).

    Attributes:
        root: Resolved snapshot directory.
        revision: The pinned commit.
        jobs: One hash job per payload file (its etag from the metadata), sorted by path.
        weight_files: The weight files a loader would read.
    """

    root: Path
    revision: str
    jobs: tuple[HashJob, ...]
    weight_files: tuple[str, ...]

    def verified(self, results: list[tuple[str, int]]) -> VerifiedSnapshot:
        """The verified snapshot, from one ``(digest, size)`` per job (each digest equal to its job's etag)."""
        pairs = zip(self.jobs, results, strict=True)
        files = tuple(VerifiedFile(job.rel, size, job.kind, digest) for job, (digest, size) in pairs)
        return VerifiedSnapshot(self.root, self.revision, files, manifest_digest(files), self.weight_files)


def plan_snapshot(path: str | os.PathLike[str], revision: str, *, allow_pickle: bool = False) -> SnapshotPlan:
    """Runs every check of :func:`verify_snapshot` but the hashing; returns what is left to hash.

    Raises:
        SnapshotIntegrityError: The reason codes of steps 1 to 5 (see the module docstring).
    """
    _require_pinned(revision)
    root = open_root(path)
    payload = scan_payload(root)
    records = _read_records(root, revision)
    matched = _match_payload(root, payload, records)
    weight_files = check_completeness(root, set(matched), allow_pickle=allow_pickle)
    check_weight_headers(root, weight_files)
    jobs = tuple(
        HashJob(rel, real, KIND_BY_ETAG_LENGTH[len(records[rel].etag)], records[rel].etag, real.stat().st_size)
        for rel, real in sorted(matched.items())
    )
    return SnapshotPlan(root, revision, jobs, weight_files)


def verify_snapshot(
    path: str | os.PathLike[str],
    revision: str,
    *,
    threads: int | None = None,
    allow_pickle: bool = False,
    progress: ProgressFn | None = None,
) -> VerifiedSnapshot:
    """Proves, offline, that a ``hf download --local-dir`` directory is exactly ``revision``.

    Every payload file must have a download metadata record naming ``revision`` and its bytes must hash to the
    recorded etag (Git blob SHA-1 or SHA-256); sizes and mtimes are never evidence. The snapshot must hold
    ``config.json`` and a complete set of weights. No weights are loaded.

    Args:
        path: The snapshot directory.
        revision: The pinned commit: 40 lowercase hex digits.
        threads: Hashing threads (``None``: one per core, at most one per file).
        allow_pickle: Accept ``.bin`` (pickle) weights when there are no safetensors weights.
        progress: Optional ``progress(delta_bytes, total_bytes)`` callback, called while hashing.

    Returns:
        The verified snapshot with its manifest digest.

    Raises:
        SnapshotIntegrityError: With a stable ``reason_code`` (see ``docs/reason_codes.md``) and the offending
            relative ``path``.
        ValueError: ``threads`` is not positive.
    """
    _require_pinned(revision)
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    plan = plan_snapshot(path, revision, allow_pickle=allow_pickle)
    return plan.verified(verify_hashes(list(plan.jobs), threads=threads, progress=progress))
