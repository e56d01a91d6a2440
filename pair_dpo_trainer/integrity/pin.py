"""``pair-dpo pin DIR``: pin a local model directory (a ``save_pretrained`` output) so it verifies like a Hub download.

Details: integrity/README.md, "Module notes", ``pin.py``.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import time
from pathlib import Path

from pair_dpo_trainer.atomic import atomic_open
from pair_dpo_trainer.errors import SnapshotIntegrityError
from pair_dpo_trainer.integrity.completeness import check_completeness
from pair_dpo_trainer.integrity.hashing import HashJob, ProgressFn, verify_hashes
from pair_dpo_trainer.integrity.layout import (
    BOOKKEEPING_PARTS,
    CACHEDIR_TAG_TEXT,
    GITIGNORE_TEXT,
    metadata_rel,
    metadata_text,
    scan_metadata,
    scan_payload,
)
from pair_dpo_trainer.integrity.snapshot import (
    VerifiedFile,
    VerifiedSnapshot,
    manifest_digest,
    manifest_listing,
    open_root,
)
from pair_dpo_trainer.integrity.weights import check_weight_headers

REVISION_PREFIX = b"pair_dpo_trainer pin v1\n"
LFS_SIZE_LIMIT = 10 * 1024 * 1024
"""Bytes above which the Hub stores a file with LFS whatever its name."""

LFS_PATTERNS = (
    "*.7z", "*.arrow", "*.bin", "*.bz2", "*.ckpt", "*.ftz", "*.gguf", "*.gz", "*.h5", "*.joblib", "*.lfs.*",
    "*.mlmodel", "*.model", "*.msgpack", "*.npy", "*.npz", "*.onnx", "*.ot", "*.parquet", "*.pb", "*.pickle",
    "*.pkl", "*.pt", "*.pth", "*.rar", "*.safetensors", "saved_model/**/*", "*.tar.*", "*.tar", "*.tflite", "*.tgz",
    "*.wasm", "*.xz", "*.zip", "*.zst", "*tfevents*",
)  # fmt: skip
"""The LFS patterns of the Hub's default ``.gitattributes``."""


def digest_kind(rel: str, size: int) -> str:
    """``"lfs"`` (SHA-256 etag) or ``"git"`` (Git blob SHA-1 etag) for a payload file, as the Hub would store it."""
    name = rel.rsplit("/", 1)[-1]
    if size > LFS_SIZE_LIMIT or any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(rel, p) for p in LFS_PATTERNS):
        return "lfs"
    return "git"


def content_revision(files: tuple[VerifiedFile, ...]) -> str:
    """The 40-hex revision of a pinned directory: SHA-1 of a version prefix and the manifest listing."""
    return hashlib.sha1(REVISION_PREFIX + manifest_listing(files)).hexdigest()


def pin_snapshot(
    path: str | os.PathLike[str],
    *,
    threads: int | None = None,
    allow_pickle: bool = False,
    force: bool = False,
    progress: ProgressFn | None = None,
) -> VerifiedSnapshot:
    """Hashes a local model directory once and writes Hub local-dir metadata naming a content-derived revision.

    Args:
        path: The model directory (``config.json`` and complete weights, e.g. a ``save_pretrained`` output).
        threads: Hashing threads (``None``: one per core, at most one per file).
        allow_pickle: Accept ``.bin`` (pickle) weights when there are no safetensors weights.
        force: Replace existing download metadata (a Hub download's, or an earlier pin's).
        progress: Optional ``progress(delta_bytes, total_bytes)`` callback, called while hashing.

    Returns:
        The snapshot as ``verify_snapshot(path, snapshot.revision)`` will see it.

    Raises:
        SnapshotIntegrityError: ``already_pinned`` (metadata exists and ``force`` is False), or the layout and
            completeness codes of ``verify_snapshot`` (``not_a_directory``, ``unsafe_path``, ``missing_config``,
            ``no_weights``, ``pickle_weights``, ``missing_shard``, ``bad_weights``, ...), ``unreadable_file``.
    """
    root = open_root(path)
    payload = scan_payload(root)
    existing = scan_metadata(root)
    if existing and not force:
        raise SnapshotIntegrityError(
            "already_pinned", f"{len(existing)} file(s) already have download metadata", metadata_rel(min(existing))
        )
    weight_files = check_completeness(root, set(payload), allow_pickle=allow_pickle)
    check_weight_headers(root, weight_files)  # a broken file is refused before it is hashed and pinned
    jobs = []
    for rel, real in sorted(payload.items()):
        size = real.stat().st_size
        jobs.append(HashJob(rel, real, digest_kind(rel, size), None, size))
    results = verify_hashes(jobs, threads=threads, progress=progress)
    files = tuple(VerifiedFile(j.rel, size, j.kind, digest) for j, (digest, size) in zip(jobs, results, strict=True))
    revision = content_revision(files)
    _write_metadata(root, files, revision, stale=set(existing) - set(payload))
    return VerifiedSnapshot(root, revision, files, manifest_digest(files), weight_files)


def _write_metadata(root: Path, files: tuple[VerifiedFile, ...], revision: str, *, stale: set[str]) -> None:
    """Writes every file's record atomically (after hashing, so each timestamp is later than its file's mtime, as
    huggingface_hub's reader requires) and removes the records of files that no longer exist."""
    bookkeeping = root.joinpath(*BOOKKEEPING_PARTS)
    bookkeeping.mkdir(parents=True, exist_ok=True)
    for name, text in ((".gitignore", GITIGNORE_TEXT), ("CACHEDIR.TAG", CACHEDIR_TAG_TEXT)):
        if not (bookkeeping / name).exists():
            with atomic_open(bookkeeping / name) as f:
                f.write(text)
    timestamp = time.time()
    for file in files:
        target = root / metadata_rel(file.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        with atomic_open(target) as f:
            f.write(metadata_text(revision, file.digest, timestamp))
    for rel in stale:
        (root / metadata_rel(rel)).unlink(missing_ok=True)
