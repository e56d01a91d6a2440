"""One run per output directory: a kernel lock held for the run's life, and a record of its holder in the lock file.

``<output_dir>/.pair_dpo.lock`` holds a JSON record of its holder (host, pid and PID namespace, start time, kernel
start ticks, boot id, a random token, a heartbeat) and is ``flock``-ed by it for the whole run. The kernel lock is the
liveness test: whatever PID namespace (container) a holder runs in, the same kernel refuses the lock to everyone
else while it lives and frees it when it ends (SIGKILL included; forked children close their copy). A pid names
another process, or none, in another namespace, so pids prove nothing there; the record only says who holds the lock.

The heartbeat (the record rewritten in place every :data:`HEARTBEAT_SECONDS`) covers what one kernel's lock cannot
speak for: a holder on another machine sharing a network filesystem, where ``flock`` may be local to each client. A
lock is taken over only when its holder is proven dead (:func:`judge`); anything else is refused with
``output_dir_in_use``, naming the holder, its last heartbeat, and ``PAIR_DPO_TAKE_OVER_LOCK=<token>``, which takes
over that one holding (never one whose kernel lock is held).

Details: fault_tolerance/README.md, "Module notes", ``lock.py``.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import errno
import json
import os
import socket
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from pair_dpo_trainer.atomic import fsync_dir
from pair_dpo_trainer.errors import RunError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

LOCK_FILENAME = ".pair_dpo.lock"
TAKE_OVER_ENV = "PAIR_DPO_TAKE_OVER_LOCK"
"""Set to a holding's token (named in the refusal) to take that lock over explicitly."""
HEARTBEAT_SECONDS = 30.0
"""How often the holder rewrites its heartbeat."""
RECORD_BYTES = 1024
"""The record is padded to a fixed size and rewritten in place (the kernel lock is the file's: never replace it)."""
LOCAL_FILESYSTEMS = frozenset(
    "ext2 ext3 ext4 xfs btrfs tmpfs ramfs overlay zfs f2fs jfs reiserfs bcachefs nilfs2 vfat exfat".split()
)
"""Filesystems one kernel owns: another kernel cannot have them mounted while this one does."""

_HELD: dict[str, tuple[OutputDirLock, int]] = {}
_HELD_GUARD = threading.Lock()


@dataclass(frozen=True)
class LockHolder:
    """The process a lock file names.

    Attributes:
        host: ``socket.gethostname()`` of the holder.
        pid: Its process id (in its own PID namespace).
        started: When it took the lock (ISO 8601, UTC).
        start_ticks: Its kernel start time (``/proc/<pid>/stat`` field 22), to tell a reused pid; None off Linux.
        boot_id: ``/proc/sys/kernel/random/boot_id`` of its kernel; None off Linux.
        token: Random id of this holding.
        pid_namespace: Its PID namespace (``/proc/self/ns/pid``), None when unknown.
        kernel_lock: It holds the file's ``flock`` for the run's life.
        heartbeat: When it last rewrote the record (ISO 8601, UTC), None for a record without heartbeat.
    """

    host: str
    pid: int
    started: str
    start_ticks: int | None
    boot_id: str | None
    token: str
    pid_namespace: str | None = None
    kernel_lock: bool = False
    heartbeat: str | None = None

    def describe(self) -> str:
        return f"host {self.host}, pid {self.pid}, started {self.started}"

    @classmethod
    def current(cls) -> LockHolder:
        now = _now()
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            started=now,
            start_ticks=process_start_ticks(os.getpid()),
            boot_id=_boot_id(),
            token=uuid.uuid4().hex,
            pid_namespace=_pid_namespace(),
            kernel_lock=True,
            heartbeat=now,
        )

    def heartbeat_age(self) -> float | None:
        """Seconds since its last heartbeat by this host's clock (None without one)."""
        try:
            beat = datetime.datetime.fromisoformat(self.heartbeat or "")
        except ValueError:
            return None
        return (datetime.datetime.now(datetime.timezone.utc) - beat).total_seconds()


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


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


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _boot_time() -> float | None:
    """This kernel's boot time (seconds since the epoch), None off Linux."""
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem ``path`` is on (``/proc/self/mountinfo``), None when unknown."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    target, best, kind = os.path.realpath(path), "", None
    for line in lines:
        fields, _, rest = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not rest:
            continue
        mount = parts[4].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, rest.split()[0]
    return kind


def judge(holder: LockHolder, kernel_lock: str, *, local_filesystem: bool) -> tuple[bool, str]:
    """Whether ``holder`` is proven dead, and why (or why it cannot be).

    Args:
        holder: The record.
        kernel_lock: ``"taken"`` (this process got the file's flock), ``"busy"`` or ``"unsupported"``.
        local_filesystem: The lock file is on a filesystem only this kernel mounts.
    """
    if kernel_lock == "busy":
        return False, "a process holds the lock file's kernel lock, so that run is alive"
    if holder.host != socket.gethostname():
        return False, f"it runs on host {holder.host}, whose processes this host cannot see"
    boot_id = _boot_id()
    if holder.boot_id is None or boot_id is None or holder.boot_id != boot_id:
        if local_filesystem and kernel_lock == "taken":
            return True, "its machine has rebooted since (another boot id)"
        age, boot = holder.heartbeat_age(), _boot_time()
        if age is not None and boot is not None and time.time() - age < boot - 60:
            return True, "its machine has rebooted since (another boot id; its last heartbeat is older than this boot)"
        return False, "it runs under another kernel (another boot id: a machine with the same host name?)"
    if kernel_lock == "taken" and holder.kernel_lock:
        return True, "its kernel lock is free, so its process has ended"
    if holder.pid_namespace is None or holder.pid_namespace != _pid_namespace():
        return False, "it runs in another PID namespace (a container) and this filesystem has no kernel lock"
    return _pid_verdict(holder)


def _pid_verdict(holder: LockHolder) -> tuple[bool, str]:
    """By pid, in the holder's own PID namespace (only where the filesystem gives no kernel lock)."""
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return True, f"no process {holder.pid} exists"
    except PermissionError:
        pass  # alive, another user's
    ticks = process_start_ticks(holder.pid)
    if ticks is not None and holder.start_ticks is not None and ticks != holder.start_ticks:
        return True, f"pid {holder.pid} is another process now"
    return False, f"process {holder.pid} is still running"


def read_holder(path: Path) -> LockHolder | None:
    """The lock file's holder, or None when there is no lock file (or it is empty).

    Raises:
        RunError: ``output_dir_in_use`` for a lock file that is not a lock record (it cannot be judged stale).
    """
    try:
        return _parse(path.read_bytes(), path)
    except FileNotFoundError:
        return None


def _parse(data: bytes, path: Path) -> LockHolder | None:
    if not data.strip():
        return None
    try:
        record = json.loads(data.decode("utf-8"))
        required = ("host", "pid", "started", "start_ticks", "boot_id", "token")
        optional = {f.name for f in dataclasses.fields(LockHolder)} - set(required)
        return LockHolder(
            **{key: record[key] for key in required}, **{key: record[key] for key in optional if key in record}
        )
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
        self._fd: int | None = None
        self._pending: int | None = None  # a descriptor acquire() opened and does not hold yet
        self._size = RECORD_BYTES
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def acquire(self) -> str | None:
        """Takes the lock; returns a warning when it took over the lock of a dead run (or on request), else None.

        Raises:
            RunError: ``output_dir_in_use`` naming the live (or unverifiable) holder.

        An exception midway (``Preempted`` from a stop signal) leaves no lock file of this holding behind.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            return self._take()
        except BaseException:
            self._abandon()
            raise

    def _take(self) -> str | None:
        for _ in range(5):
            fd = self._pending = _open(self.path)
            if fd is None:
                fd = self._pending = self._create()
                if fd is None:
                    continue  # created by another run in between: judge that one
                self._hold(fd)
                return None
            try:
                warning = self._judge_existing(fd)
            except RunError:
                os.close(fd)
                self._pending = None
                raise
            if warning is not None:
                return warning or None
            self._pending = None  # closed by the judge: removed or replaced meanwhile
        raise RunError("output_dir_in_use", f"{self.path} keeps changing: another run is starting in {self.directory}")

    def _abandon(self) -> None:
        """After an exception in :meth:`acquire`: removes the lock file if it holds this holding's record (never
        another run's, nor a dead run's record it was taking over), while still locked, then closes what it opened."""
        if self._fd is not None:
            self.release()
            return
        pending, self._pending = self._pending, None
        try:
            holder = read_holder(self.path)
            if holder is not None and holder.token == self.holder.token:
                self.path.unlink(missing_ok=True)
                fsync_dir(self.directory)
        except (RunError, OSError):
            pass
        finally:
            if pending is not None:
                with contextlib.suppress(OSError):
                    os.close(pending)

    def _judge_existing(self, fd: int) -> str | None:
        """Takes over the file open as ``fd`` if its holder is proven dead (returns the warning); None: look again."""
        kernel = _try_flock(fd)
        if not _same_file(fd, self.path):
            os.close(fd)  # removed or replaced meanwhile
            return None
        holder = _parse(os.pread(fd, 1 << 16, 0), self.path) if kernel != "busy" else _parse_quietly(fd, self.path)
        if holder is None and kernel != "busy":
            self._hold(fd)  # an empty lock file: nobody's record
            return ""
        if holder is not None and holder.token == self.holder.token:
            self._hold(fd)
            return ""
        local = filesystem_type(self.directory) in LOCAL_FILESYSTEMS
        dead, why = judge(holder, kernel, local_filesystem=local) if holder is not None else (False, "")
        forced = holder is not None and kernel != "busy" and os.environ.get(TAKE_OVER_ENV) == holder.token
        if not (dead or forced):
            raise RunError("output_dir_in_use", _in_use_message(self.path, holder, why, kernel))
        self._hold(fd)
        assert holder is not None
        how = why if dead else f"taken over as {TAKE_OVER_ENV} asks ({why})"
        return (
            f"output_dir {self.directory}: took over the lock {self.path} of a run that is no longer alive "
            f"({holder.describe()}): {how}; its last complete checkpoint is intact, an interrupted save is ignored."
        )

    def _create(self) -> int | None:
        """A new lock file, kernel-locked before it appears under its name; None if the name exists already."""
        tmp = self.path.with_name(f"{self.path.name}.{uuid.uuid4().hex}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            kernel = _try_flock(fd)
            self._write(fd, kernel == "taken")
            os.link(tmp, self.path)
            self._pending = fd  # under its name now: acquire()'s clean-up closes it after removing the name
        except FileExistsError:
            os.close(fd)
            return None
        except OSError as exc:  # no hard links here: create the name itself exclusively, lock it, then write
            os.close(fd)
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                raise
            return self._create_in_place()
        except BaseException:
            os.close(fd)
            raise
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(self.directory)
        return fd

    def _create_in_place(self) -> int | None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        except FileExistsError:
            return None
        kernel = _try_flock(fd)
        if kernel == "busy":  # another run opened the new file and locked it first: it is theirs
            os.close(fd)
            return None
        self._write(fd, kernel == "taken")
        fsync_dir(self.directory)
        return fd

    def _write(self, fd: int, kernel_lock: bool) -> None:
        self.holder = dataclasses.replace(self.holder, kernel_lock=kernel_lock, heartbeat=_now())
        data = (json.dumps(asdict(self.holder), indent=1) + "\n").encode("utf-8")
        self._size = max(self._size, len(data))
        os.pwrite(fd, data.ljust(self._size), 0)  # same size every time: never a moment of a shorter record
        os.fsync(fd)

    def _hold(self, fd: int) -> None:
        """Keeps ``fd`` (and its kernel lock) until :meth:`release`; writes this holder's record; starts the beat."""
        self._fd, self._pending = fd, None
        _OPEN_FDS.add(fd)
        kernel = _try_flock(fd)  # already taken (a no-op) unless unsupported here
        self._write(fd, kernel == "taken")
        os.ftruncate(fd, self._size)  # a longer record of an earlier holder must not trail this one
        fsync_dir(self.directory)
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, name="pair-dpo-lock-heartbeat", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            fd = self._fd
            if fd is None:
                return
            try:
                self._write(fd, self.holder.kernel_lock)
            except OSError:
                continue  # a slow or full filesystem: the next beat tries again

    def release(self) -> None:
        """Removes the lock file if it is still this holder's (never another run's), then frees the kernel lock."""
        fd, self._fd = self._fd, None
        self._stop.set()
        if self._beat is not None and self._beat is not threading.current_thread():
            self._beat.join(timeout=10)
        if fd is None:
            return
        try:
            holder = _parse(os.pread(fd, 1 << 16, 0), self.path)
            if holder is not None and holder.token == self.holder.token and _same_file(fd, self.path):
                self.path.unlink(missing_ok=True)  # while still locked: a waiting run then sees the name gone
                fsync_dir(self.directory)
        except (RunError, OSError):
            pass
        finally:
            _OPEN_FDS.discard(fd)
            os.close(fd)


_OPEN_FDS: set[int] = set()


def _open(path: Path) -> int | None:
    try:
        return os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None


def _try_flock(fd: int) -> str:
    """``"taken"``, ``"busy"`` (another open file holds it) or ``"unsupported"`` (no flock on this filesystem)."""
    if fcntl is None:  # pragma: no cover - not POSIX
        return "unsupported"
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return "taken"
        except BlockingIOError:
            return "busy"
        except InterruptedError:
            continue
        except OSError:  # ENOLCK, ENOSYS, EOPNOTSUPP, EINVAL: a network filesystem without (this kind of) locks
            return "unsupported"


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _parse_quietly(fd: int, path: Path) -> LockHolder | None:
    """The record of a live holder (for the message): None when it cannot be read as one."""
    try:
        return _parse(os.pread(fd, 1 << 16, 0), path)
    except (RunError, OSError):
        return None


def _in_use_message(path: Path, holder: LockHolder | None, why: str, kernel: str) -> str:
    who = holder.describe() if holder is not None else "its record cannot be read"
    age = holder.heartbeat_age() if holder is not None else None
    beat = "" if age is None else f"; its last heartbeat was {max(age, 0):.0f} s ago"
    if kernel == "busy":
        state = "a process holds the lock file's kernel lock, so that run is alive"
        fix = "wait for it to finish (or stop it), or set another output_dir"
    else:
        state = f"this run cannot prove it dead: {why}{beat}"
        token = holder.token if holder is not None else "<token>"
        fix = (
            f"set another output_dir; if that run is gone, take the lock over explicitly: run again with "
            f"{TAKE_OVER_ENV}={token} (or delete {path})"
        )
    return (
        f"output_dir {path.parent} is in use by another run ({who}; lock file {path}): {state}. Two runs in one "
        f"output_dir overwrite each other's checkpoints, so this one refuses to start: {fix}."
    )


def output_dir_problem(directory: str | os.PathLike[str]) -> str | None:
    """Why this process cannot write the run's ``output_dir``, or None; checked before anything loads.

    A file is created and removed in ``directory``, or, while it does not exist yet, in its nearest existing parent
    (nothing else is created): a read-only directory or filesystem, another user's directory or a path through a file
    fails here instead of in the first save, after the model loaded.
    """
    path = Path(os.path.abspath(directory))
    existing = path
    while not os.path.exists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"output_dir {path}: {existing} is a file, not a directory. Choose another --output_dir."
    try:
        fd, probe = tempfile.mkstemp(prefix=".pair_dpo_write_probe.", dir=existing)
    except OSError as error:
        return (
            f"output_dir {path} cannot be written ({existing}: {error.strerror or error}): the run saves its "
            "checkpoints and model there. Make it writable for this user, or choose another --output_dir."
        )
    os.close(fd)
    os.unlink(probe)
    return None


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
        try:
            warning = lock.acquire() or None
            _HELD[key] = (lock, 1)
        except BaseException:  # a stop signal between the two: the lock taken, not yet known to release it
            lock.release()
            raise
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


def _forget_in_child() -> None:
    """In a forked child: close the inherited lock descriptors (the lock ends with its holder, not with the last of
    its children, e.g. DataLoader workers) and forget the holds (the child's exit must not remove the parent's lock
    file)."""
    _HELD.clear()
    for fd in list(_OPEN_FDS):
        try:
            os.close(fd)
        except OSError:
            pass
    _OPEN_FDS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
