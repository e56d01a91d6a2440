"""Atomic file writes: a temporary file in the target's directory, fsync, then ``os.replace``.

A reader sees the old file or the complete new one, never a partial write, and a crash leaves no half-written target.
``fsync_dir`` / ``fsync_tree`` make renames and whole directory trees durable (atomic checkpoints,
``fault_tolerance/checkpoint.py``). ``disk_full`` / ``unwritable`` tell from an exception chain whether a write failed
for a full (or over-quota) or a read-only / forbidden filesystem, and ``space_text`` says how much room is left, for
the errors of every writer above (checkpoints: ``disk_full``; the tokenised-pairs cache: ``dataset_cache_unwritable``).

Reads of files another user may have written (checkpoints, manifests, snapshots, cache entries) go through
:func:`open_regular`: ``open`` of a FIFO blocks until a writer comes, so a FIFO in their place would hang the reader
(and every rank waiting on it) forever; it is refused instead, as are sockets and devices.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, cast

DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
"""The errnos of a full filesystem or an exceeded quota."""
UNWRITABLE_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
"""The errnos of a read-only filesystem or a directory this process may not write."""
_DISK_FULL_TEXT = ("no space left on device", "storagefull", "os error 28", "disk quota exceeded")
_UNWRITABLE_TEXT = ("read-only file system", "permission denied", "operation not permitted")
_WRITER_FAILURE_TEXT = ("file write failed", "iostream error", "pytorchstreamwriter failed", "unexpected pos")
_KINDS = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFDIR: "a directory",
    stat.S_IFLNK: "a symbolic link",
}
NEARLY_FULL_BYTES = 64 * 2**20
"""Below this much free space, a writer's failure without an errno counts as a full disk (:func:`disk_full`)."""


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


def exception_chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes / contexts, outermost first (each once)."""
    chain: list[BaseException] = []
    cursor: BaseException | None = exc
    while cursor is not None and cursor not in chain:
        chain.append(cursor)
        cursor = cursor.__cause__ or cursor.__context__
    return chain


def _in_chain(exc: BaseException, errnos: frozenset[int], texts: tuple[str, ...]) -> bool:
    chain = exception_chain(exc)
    if any(isinstance(e, OSError) and e.errno in errnos for e in chain):
        return True
    return any(marker in str(e).lower() for e in chain for marker in texts)


def disk_full(exc: BaseException, directory: str | os.PathLike[str]) -> bool:
    """True when ``exc`` (or an exception in its chain) comes from a full filesystem or quota under ``directory``.

    An ``OSError`` with ``ENOSPC`` / ``EDQUOT``, or a message that says so (pyarrow's and Rust writers' texts carry
    no errno). torch's C++ writer reports a full disk without either (``basic_ios::clear: iostream error``,
    ``PytorchStreamWriter failed writing file``): such a writer error counts when less than
    :data:`NEARLY_FULL_BYTES` is left on ``directory``'s filesystem.
    """
    if _in_chain(exc, DISK_FULL_ERRNOS, _DISK_FULL_TEXT):
        return True
    free, _ = disk_space(directory)
    return free is not None and free < NEARLY_FULL_BYTES and _in_chain(exc, frozenset(), _WRITER_FAILURE_TEXT)


def unwritable(exc: BaseException) -> bool:
    """True when ``exc`` (or an exception in its chain) comes from a read-only filesystem or a missing permission
    (``EROFS`` / ``EACCES`` / ``EPERM``, or a message that says so)."""
    return _in_chain(exc, UNWRITABLE_ERRNOS, _UNWRITABLE_TEXT)


def disk_space(path: str | os.PathLike[str]) -> tuple[int | None, int | None]:
    """``(free, total)`` bytes of the filesystem holding ``path`` (its nearest existing parent when ``path`` does not
    exist yet); ``(None, None)`` when it cannot be asked."""
    target = Path(path).absolute()
    while not target.exists() and target.parent != target:
        target = target.parent
    try:
        usage = shutil.disk_usage(target)
    except OSError:
        return None, None
    return usage.free, usage.total


def format_bytes(value: int | None) -> str:
    """``value`` bytes in MiB (KiB below 1 MiB); ``?`` for None."""
    if value is None:
        return "?"
    return f"{value / 2**20:.1f} MiB" if value >= 2**20 else f"{value / 2**10:.1f} KiB"


def space_text(path: str | os.PathLike[str]) -> str:
    """``"<free> free of <total>"`` for the filesystem of ``path``, or ``"free space unknown"``."""
    free, total = disk_space(path)
    return "free space unknown" if free is None else f"{format_bytes(free)} free of {format_bytes(total)}"


class NotRegularFile(OSError):
    """A path that should be a regular file is something else (a FIFO, a socket, a device, a directory)."""


def file_kind(mode: int) -> str:
    """What an ``st_mode`` is, in words (``"a FIFO (named pipe)"``, ``"a regular file"``)."""
    return "a regular file" if stat.S_ISREG(mode) else _KINDS.get(stat.S_IFMT(mode), "a special file")


def require_regular(path: str | os.PathLike[str], *, follow_symlinks: bool = True) -> os.stat_result:
    """``path``'s ``stat`` (``lstat`` unless ``follow_symlinks``) when it is a regular file, for readers that open it
    themselves (safetensors' ``load_file``).

    Raises:
        NotRegularFile: ``path`` is a FIFO, socket, device or directory (or a symlink, unless ``follow_symlinks``).
        OSError: It cannot be stat-ed.
    """
    info = os.stat(path) if follow_symlinks else os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        raise NotRegularFile(f"{path} is {file_kind(info.st_mode)}, not a regular file")
    return info


def open_regular(
    path: str | os.PathLike[str], *, follow_symlinks: bool = True, buffering: int = -1
) -> io.BufferedReader | io.FileIO:
    """Opens ``path`` for binary reading only if it is a regular file; never blocks on a FIFO.

    ``lstat`` (``stat`` when ``follow_symlinks``) first refuses a special file; the open itself is non-blocking and
    the opened descriptor is checked again (``fstat``), so a FIFO swapped in between is refused too.

    Raises:
        NotRegularFile: ``path`` is a FIFO, socket, device or directory (or a symlink, unless ``follow_symlinks``).
        OSError: It cannot be opened.
    """
    require_regular(path, follow_symlinks=follow_symlinks)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    flags |= 0 if follow_symlinks else getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegularFile(f"{path} is {file_kind(info.st_mode)}, not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return cast("io.BufferedReader | io.FileIO", os.fdopen(fd, "rb", buffering=buffering))
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike[str], *, limit: int, follow_symlinks: bool = True) -> bytes:
    """The bytes of the regular file ``path`` (:func:`open_regular`), refused when larger than ``limit``.

    Raises:
        NotRegularFile: As :func:`open_regular`.
        ValueError: The file holds more than ``limit`` bytes.
        OSError: It cannot be read.
    """
    with open_regular(path, follow_symlinks=follow_symlinks) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path} is larger than {limit} bytes")
    return data
