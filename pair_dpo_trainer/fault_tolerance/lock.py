"""One run per output directory: an exclusive lock file held for the run's lifetime.

``<output_dir>/.pair_dpo.lock`` is a small JSON record of its holder (host, pid, start time, the process's kernel
start ticks and the machine's boot id, a random token). It is created atomically: the complete record is written to a
temporary file and hard-linked to the lock name, which fails if the name exists (``O_EXCL`` semantics, also on NFS),
so a reader never sees a half-written lock. The check-and-create runs under an advisory ``flock`` of the directory
where the filesystem supports it, so two runs taking over the same stale lock cannot both win.

Details: docs/architecture.md, "Module notes", ``fault_tolerance/lock.py``.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import errno
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from pair_dpo_trainer.atomic import atomic_open, fsync_dir
from pair_dpo_trainer.errors import RunError

LOCK_FILENAME = ".pair_dpo.lock"

_HELD: dict[str, tuple[OutputDirLock, int]] = {}
_HELD_GUARD = threading.Lock()


@dataclass(frozen=True)
class LockHolder:
    """The process a lock file names.

    Attributes:
        host: ``socket.gethostname()`` of the holder.
        pid: Its process id.
        started: When it took the lock (ISO 8601, UTC).
        start_ticks: Its kernel start time (``/proc/<pid>/stat`` field 22), to tell a reused pid; None off Linux.
        boot_id: ``/proc/sys/kernel/random/boot_id`` of its machine; None off Linux.
        token: Random id of this holding.
    """

    host: str
    pid: int
    started: str
    start_ticks: int | None
    boot_id: str | None
    token: str

    def describe(self) -> str:
        return f"host {self.host}, pid {self.pid}, started {self.started}"

    @classmethod
    def current(cls) -> LockHolder:
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            start_ticks=process_start_ticks(os.getpid()),
            boot_id=_boot_id(),
            token=uuid.uuid4().hex,
        )


def process_start_ticks(pid: int) -> int | None:
    """The kernel start time of ``pid`` in clock ticks since boot, or None (no such process, or not Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:  # the command name (field 2) may hold spaces and parentheses: split after its last ')'
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (IndexError, ValueError):
        return None


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def holder_is_dead(holder: LockHolder) -> bool | None:
    """True when the holder is certainly dead, False when it runs, None when this host cannot tell (another host)."""
    if holder.host != socket.gethostname():
        return None
    boot_id = _boot_id()
    if holder.boot_id and boot_id and holder.boot_id != boot_id:
        return True
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, another user's
    ticks = process_start_ticks(holder.pid)
    return ticks is not None and holder.start_ticks is not None and ticks != holder.start_ticks


def read_holder(path: Path) -> LockHolder | None:
    """The lock file's holder, or None when there is no lock file.

    Raises:
        RunError: ``output_dir_in_use`` for a lock file that is not a lock record (it cannot be judged stale).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        return LockHolder(**{key: data[key] for key in LockHolder.__dataclass_fields__})
    except (ValueError, KeyError, TypeError):
        raise RunError(
            "output_dir_in_use",
            f"{path} exists but is not a pair_dpo lock record, so this run cannot tell whether another run uses "
            f"{path.parent}: if no run is using that output_dir, delete {path}; otherwise set another output_dir.",
        ) from None


class OutputDirLock:
    """The exclusive lock of one output directory, held by this process.

    Args:
        directory: The run's ``output_dir`` (created if missing).
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILENAME
        self.holder = LockHolder.current()

    def acquire(self) -> str | None:
        """Takes the lock; returns a warning when it took over the lock of a dead run, else None.

        Raises:
            RunError: ``output_dir_in_use`` naming the live (or unverifiable) holder.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        record = json.dumps(asdict(self.holder), indent=2) + "\n"
        with _directory_flock(self.directory):
            for _ in range(3):
                holder = read_holder(self.path)
                if holder is None:
                    if _create_exclusive(self.path, record):
                        return None
                    continue  # created by another run in between: judge that one
                if holder.token == self.holder.token:
                    return None
                if holder_is_dead(holder):
                    _replace(self.path, record)
                    return (
                        f"output_dir {self.directory}: took over the lock {self.path} of a run that is no longer "
                        f"alive ({holder.describe()}); its last complete checkpoint is intact, an interrupted save "
                        "is ignored."
                    )
                raise RunError("output_dir_in_use", _in_use_message(self.path, holder))
        raise RunError("output_dir_in_use", f"{self.path} keeps changing: another run is starting in {self.directory}")

    def release(self) -> None:
        """Removes the lock file if it is still this holder's (never another run's)."""
        try:
            holder = read_holder(self.path)
        except RunError:
            return
        if holder is not None and holder.token == self.holder.token:
            self.path.unlink(missing_ok=True)
            fsync_dir(self.directory)


def _in_use_message(path: Path, holder: LockHolder) -> str:
    same_host = holder.host == socket.gethostname()
    if same_host:
        state = "that process is still running on this host"
        fix = "wait for it to finish (or stop it), or set another output_dir"
    else:
        state = "this host cannot tell whether that process is alive"
        fix = f"set another output_dir; if that run is gone (check host {holder.host}), delete {path}"
    return (
        f"output_dir {path.parent} is in use by another run ({holder.describe()}; lock file {path}): {state}. Two runs "
        f"in one output_dir overwrite each other's checkpoints, so this one refuses to start: {fix}."
    )


def _create_exclusive(path: Path, record: str) -> bool:
    """Creates ``path`` with ``record`` atomically; False if it exists. The content is complete when it appears."""
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        _write_synced(f, record)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    except OSError as exc:  # a filesystem without hard links: O_EXCL creation (content written right after)
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            _write_synced(f, record)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return True


def _write_synced(f, record: str) -> None:
    f.write(record)
    f.flush()
    os.fsync(f.fileno())


def _replace(path: Path, record: str) -> None:
    with atomic_open(path) as f:
        f.write(record)
    fsync_dir(path.parent)


@contextlib.contextmanager
def _directory_flock(directory: Path) -> Iterator[None]:
    """An exclusive advisory lock of ``directory`` while judging the lock file; a no-op where unsupported."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        deadline = time.monotonic() + 30.0
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break  # judge without the guard rather than wait forever
                time.sleep(0.05)
            except OSError:
                break  # flock unsupported here (some network filesystems)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the flock


def acquire_output_dir(directory: str | os.PathLike[str]) -> str | None:
    """Takes (or re-enters) this process's lock of ``directory``; returns a takeover warning or None.

    Raises:
        RunError: ``output_dir_in_use`` (see :meth:`OutputDirLock.acquire`).
    """
    key = os.path.realpath(directory)
    with _HELD_GUARD:
        if key in _HELD:
            lock, count = _HELD[key]
            _HELD[key] = (lock, count + 1)
            return None
        lock = OutputDirLock(directory)
        warning = lock.acquire()
        _HELD[key] = (lock, 1)
        return warning


def release_output_dir(directory: str | os.PathLike[str]) -> None:
    """Drops one hold of ``directory``; the lock file goes with the last one."""
    key = os.path.realpath(directory)
    with _HELD_GUARD:
        if key not in _HELD:
            return
        lock, count = _HELD.pop(key)
        if count > 1:
            _HELD[key] = (lock, count - 1)
            return
    lock.release()


@atexit.register
def _release_all() -> None:
    with _HELD_GUARD:
        locks = [lock for lock, _ in _HELD.values()]
        _HELD.clear()
    for lock in locks:
        lock.release()
