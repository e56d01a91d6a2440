"""Atomic file writes: a temporary file in the target's directory, fsync, then ``os.replace``.

A reader sees the old file or the complete new one, never a partial write, and a crash leaves no half-written target.
``fsync_dir`` / ``fsync_tree`` make renames and whole directory trees durable (atomic checkpoints,
``fault_tolerance/checkpoint.py``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "w", **kwargs: Any) -> Iterator[IO[Any]]:
    """Opens a temporary sibling of ``path`` for writing; on a clean exit it replaces ``path`` atomically.

    Args:
        path: The target file (its directory must exist).
        mode: ``"w"`` (text, UTF-8 unless ``encoding`` is given) or ``"wb"``.
        **kwargs: Passed to ``os.fdopen``.

    Example:
        >>> import tempfile, pathlib
        >>> target = pathlib.Path(tempfile.mkdtemp()) / "a.json"
        >>> with atomic_open(target) as f:
        ...     _ = f.write("{}")
        >>> target.read_text()
        '{}'
    """
    target = Path(path)
    if "b" not in mode:
        kwargs.setdefault("encoding", "utf-8")
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flushes a directory's entries (a rename or a new file in it) to stable storage.

    Filesystems that cannot open or fsync a directory (some network filesystems) are skipped silently: their rename
    is as durable as the server makes it.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike[str]) -> None:
    """Flushes every regular file and directory under ``root`` (``root`` included) to stable storage.

    Raises:
        OSError: from ``fsync`` (``ENOSPC`` / ``EIO`` for data that could not be written back).
    """
    for directory, _, files in os.walk(root):
        for name in files:
            path = os.path.join(directory, name)
            if os.path.islink(path):
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(directory)
