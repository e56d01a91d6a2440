"""Snapshot layout: payload discovery, download metadata parsing and path safety.

A directory written by ``hf download REPO --revision SHA --local-dir DIR`` holds the repository files (the
*payload*) and, for every payload file ``P``, ``DIR/.cache/huggingface/download/P.metadata`` with three
lines: the 40-hex commit, the etag (Git blob SHA-1 or LFS SHA-256) and a float timestamp. Everything under
``DIR/.cache/huggingface/`` is bookkeeping (``.gitignore``, ``CACHEDIR.TAG``, ``*.lock``, ``*.incomplete``,
the metadata files themselves), never payload. Nothing here reads payload bytes.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from pair_dpo_trainer.atomic import open_regular
from pair_dpo_trainer.errors import SnapshotIntegrityError

BOOKKEEPING_PARTS = (".cache", "huggingface")
DOWNLOAD_DIR_PARTS = (*BOOKKEEPING_PARTS, "download")
METADATA_SUFFIX = ".metadata"
METADATA_MAX_BYTES = 4096
# What huggingface_hub writes in DIR/.cache/huggingface/ besides the metadata (`_local_folder._huggingface_dir`).
GITIGNORE_TEXT = "*"
CACHEDIR_TAG_TEXT = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file is a cache directory tag created by huggingface_hub.\n"
    "# For information about cache directory tags, see:\n"
    "#\thttps://bford.info/cachedir/\n"
)

_COMMIT_RE = re.compile(r"[0-9a-f]{40}")
_ETAG_RE = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_DRIVE_RE = re.compile(r"[A-Za-z]:")


@dataclass(frozen=True)
class FileMetadata:
    """The parsed ``.metadata`` record of one payload file.

    Attributes:
        path: Repository path of the payload file (``/``-separated, relative to the snapshot root).
        commit: 40-hex commit hash the file was downloaded from.
        etag: Lowercase hex etag: 40 digits (Git blob SHA-1) or 64 digits (LFS SHA-256).
        timestamp: Download timestamp (informational; never used as evidence).
        metadata_path: Path of the metadata file relative to the snapshot root.
    """

    path: str
    commit: str
    etag: str
    timestamp: float
    metadata_path: str


def metadata_text(commit: str, etag: str, timestamp: float) -> str:
    """The content of one ``.metadata`` file, as ``huggingface_hub._local_folder.write_download_metadata`` writes it:
    ``f"{commit}\\n{etag}\\n{timestamp}\\n"``."""
    return f"{commit}\n{etag}\n{timestamp!r}\n"


def metadata_rel(payload_rel: str) -> str:
    """``.cache/huggingface/download/<payload_rel>.metadata``: where a payload file's record lives."""
    return "/".join(DOWNLOAD_DIR_PARTS) + "/" + payload_rel + METADATA_SUFFIX


def is_pinned_revision(revision: object) -> bool:
    """True for a full 40-hex lowercase commit hash (not a branch, tag or short SHA)."""
    return isinstance(revision, str) and _COMMIT_RE.fullmatch(revision) is not None


def is_bookkeeping(rel: str) -> bool:
    """True when ``rel`` (relative, ``/``-separated) lies under ``.cache/huggingface/``."""
    return tuple(rel.split("/")[:2]) == BOOKKEEPING_PARTS


def check_repo_path(value: object, *, what: str) -> str:
    """Validates a repository-relative path taken from an index, a metadata file name or a directory walk.

    Args:
        value: Candidate path.
        what: Where the path comes from (used in the message).

    Returns:
        ``value`` unchanged.

    Raises:
        SnapshotIntegrityError: ``unsafe_path`` for a non-string, empty, absolute, drive-qualified path, one
            with backslashes, NUL, ``.``/``..`` or empty parts, one not encodable as UTF-8, or a bookkeeping
            path.
    """
    reason = None
    if not isinstance(value, str) or not value:
        reason = "empty or not a string"
    elif "\\" in value or "\0" in value:
        reason = "contains a backslash or NUL"
    elif value.startswith("/") or _DRIVE_RE.match(value):
        reason = "is absolute"
    elif any(part in ("", ".", "..") for part in value.split("/")):
        reason = "has an empty, '.' or '..' part"
    elif is_bookkeeping(value):
        reason = "points into .cache/huggingface/ bookkeeping"
    else:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            reason = "is not valid UTF-8"
    if reason is not None:
        raise SnapshotIntegrityError("unsafe_path", f"{what} path {value!r} {reason}", str(value))
    return str(value)


def resolve_inside(root: Path, rel: str, *, what: str) -> Path:
    """Resolves ``root/rel`` (following symlinks) and checks it stays inside ``root`` and outside bookkeeping.

    Args:
        root: The resolved snapshot root.
        rel: Path relative to ``root``.
        what: Description for the message.

    Returns:
        The resolved absolute path (it may not exist).

    Raises:
        SnapshotIntegrityError: ``unsafe_path`` when the path resolves outside the snapshot or into
            ``.cache/huggingface/``.
    """
    real = Path(os.path.realpath(root / rel))
    try:
        inner = real.relative_to(root).as_posix()
    except ValueError:
        raise SnapshotIntegrityError("unsafe_path", f"{what} resolves outside the snapshot (to {real})", rel) from None
    if inner != "." and is_bookkeeping(inner):
        raise SnapshotIntegrityError("unsafe_path", f"{what} resolves into .cache/huggingface/ bookkeeping", rel)
    return real


def _walk_error(exc: OSError) -> None:
    raise SnapshotIntegrityError("unreadable_file", f"cannot list directory: {exc}", exc.filename)


def _check_entry(root: Path, rel: str, *, what: str) -> Path | None:
    """Checks one walked file entry; returns its resolved path, or ``None`` for a dangling symlink."""
    check_repo_path(rel, what=what)
    full = root / rel
    if not full.is_symlink():
        real = full
    else:
        real = resolve_inside(root, rel, what=f"symlink {rel!r}")
        if not real.exists():
            return None
    if not real.is_file():
        raise SnapshotIntegrityError("unsafe_path", f"{what} {rel!r} is not a regular file", rel)
    return real


def scan_payload(root: Path) -> dict[str, Path]:
    """Lists payload files (everything outside ``.cache/huggingface/``) without reading them.

    Symlinks are not followed while walking; each one (to a file or a directory) must resolve inside the
    snapshot. Dangling symlinks inside the snapshot are ignored (a metadata record naming one is
    ``file_missing``).

    Args:
        root: The resolved snapshot root.

    Returns:
        Mapping from repository path to resolved file path.

    Raises:
        SnapshotIntegrityError: ``unsafe_path`` (escaping symlink, bad name, special file) or
            ``unreadable_file``.
    """
    payload: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False, onerror=_walk_error):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        prefix = "" if rel_dir == "." else rel_dir + "/"
        if prefix == BOOKKEEPING_PARTS[0] + "/" and BOOKKEEPING_PARTS[1] in dirnames:
            dirnames.remove(BOOKKEEPING_PARTS[1])
        for name in sorted(dirnames):
            if (Path(dirpath) / name).is_symlink():
                resolve_inside(root, prefix + name, what=f"directory symlink {prefix + name!r}")
        for name in filenames:
            rel = prefix + name
            real = _check_entry(root, rel, what="payload file")
            if real is not None:
                payload[rel] = real
    return payload


def scan_metadata(root: Path) -> dict[str, Path]:
    """Lists ``.metadata`` files under ``.cache/huggingface/download/`` by the payload path they describe.

    Other bookkeeping files there (``*.lock``, ``*.incomplete``) are ignored.

    Args:
        root: The resolved snapshot root.

    Returns:
        Mapping from payload repository path to the metadata file's resolved path.

    Raises:
        SnapshotIntegrityError: ``unsafe_path`` for a metadata file, directory or derived payload path that is
            unsafe or escapes the snapshot.
    """
    download = root.joinpath(*DOWNLOAD_DIR_PARTS)
    if not download.exists():
        return {}
    real_download = Path(os.path.realpath(download))
    try:
        real_download.relative_to(root)
    except ValueError:
        raise SnapshotIntegrityError(
            "unsafe_path",
            "the metadata directory resolves outside the snapshot",
            "/".join(DOWNLOAD_DIR_PARTS),
        ) from None
    found: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(download, followlinks=False, onerror=_walk_error):
        rel_dir = Path(dirpath).relative_to(download).as_posix()
        prefix = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = [d for d in dirnames if not (Path(dirpath) / d).is_symlink()]
        for name in filenames:
            if not name.endswith(METADATA_SUFFIX):
                continue
            payload_rel = prefix + name[: -len(METADATA_SUFFIX)]
            meta_rel = metadata_rel(payload_rel)
            check_repo_path(payload_rel, what=f"metadata file {meta_rel!r} names a payload")
            full = Path(dirpath) / name
            found[payload_rel] = resolve_inside_metadata(root, full, meta_rel) if full.is_symlink() else full
    return found


def resolve_inside_metadata(root: Path, full: Path, meta_rel: str) -> Path:
    """Resolves a symlinked metadata file; it must stay inside the snapshot."""
    real = Path(os.path.realpath(full))
    try:
        real.relative_to(root)
    except ValueError:
        raise SnapshotIntegrityError(
            "unsafe_path", f"metadata symlink resolves outside the snapshot (to {real})", meta_rel
        ) from None
    return real


def parse_metadata(payload_rel: str, metadata_file: Path) -> FileMetadata:
    """Reads and strictly parses one ``.metadata`` file.

    The accepted form is what ``huggingface_hub._local_folder.write_download_metadata`` writes: exactly three
    lines, the 40-hex lowercase commit, a 40- or 64-hex lowercase etag and a finite float timestamp.

    Args:
        payload_rel: Repository path of the payload file it describes.
        metadata_file: Path of the metadata file.

    Returns:
        The parsed record.

    Raises:
        SnapshotIntegrityError: ``metadata_malformed`` (path: the payload path).
    """
    meta_rel = metadata_rel(payload_rel)

    def bad(why: str) -> SnapshotIntegrityError:
        return SnapshotIntegrityError("metadata_malformed", f"{meta_rel}: {why}", payload_rel)

    try:
        with open_regular(metadata_file) as f:
            raw = f.read(METADATA_MAX_BYTES + 1)
    except OSError as exc:
        raise bad(f"cannot read ({exc})") from exc
    if len(raw) > METADATA_MAX_BYTES:
        raise bad(f"larger than {METADATA_MAX_BYTES} bytes")
    try:
        lines = [line.strip() for line in raw.decode("ascii").splitlines()]
    except UnicodeDecodeError:
        raise bad("not ASCII text") from None
    if len(lines) != 3:
        raise bad(f"expected 3 lines (commit, etag, timestamp), found {len(lines)}")
    commit, etag, stamp = lines
    if not _COMMIT_RE.fullmatch(commit):
        raise bad(f"line 1 is not a 40-hex lowercase commit: {commit!r}")
    if not _ETAG_RE.fullmatch(etag):
        raise bad(f"line 2 is not a 40- or 64-hex lowercase etag: {etag!r}")
    try:
        timestamp = float(stamp)
    except ValueError:
        raise bad(f"line 3 is not a float timestamp: {stamp!r}") from None
    if not math.isfinite(timestamp):
        raise bad(f"line 3 is not a finite timestamp: {stamp!r}")
    return FileMetadata(payload_rel, commit, etag, timestamp, meta_rel)
