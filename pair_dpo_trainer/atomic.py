"""Atomic file writes: a temporary file in the target's directory, fsync, then ``os.replace``.

A reader sees the old file or the complete new one, never a partial write, and a crash leaves no half-written target.
"""

from __future__ import annotations

import contextlib
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
