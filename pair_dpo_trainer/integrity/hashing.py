"""Streaming, bounded-memory, multi-threaded file hashing for snapshot verification.

Two digests are used by the Hugging Face Hub as file etags:

* ``"git"``: the Git blob SHA-1 of a regular Git file, ``sha1(b"blob <size>\\0" + bytes)`` (40 hex digits);
* ``"lfs"``: the SHA-256 of an LFS file's content (64 hex digits).

Files are read with ``readinto`` into one reusable buffer per thread (``CHUNK_SIZE`` bytes), so memory
stays bounded whatever the file size; ``hashlib`` releases the GIL on large buffers, so files hash in
parallel threads.

The package's own files (``prepare-data`` splits, tokenised-pairs cache entries) carry a third digest, one that one
large file can be checked with on every core: :data:`CHUNKED_FORMAT` (:class:`ChunkedSha256` while writing,
:func:`chunked_file_digest` when reading back).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pair_dpo_trainer.atomic import open_regular
from pair_dpo_trainer.errors import SnapshotIntegrityError

CHUNK_SIZE = 8 * 1024 * 1024
"""Bytes read per ``readinto`` call (and size of each thread's reusable buffer)."""

KIND_BY_ETAG_LENGTH = {40: "git", 64: "lfs"}
"""Digest kind implied by the length of a hexadecimal etag."""

ProgressFn = Callable[[int, int], None]
"""``progress(bytes_just_hashed, total_bytes)``; called from worker threads, serialised by a lock."""

CHUNKED_FORMAT = "pair_dpo_trainer.sha256-chunks/1"
"""The chunked digest: the SHA-256 of ``"<format> <chunk_bytes> <size>\\n"`` followed by the 32-byte SHA-256 of each
consecutive ``chunk_bytes`` piece of the file, in order (one piece, empty, for an empty file)."""

DIGEST_CHUNK_BYTES = 64 * 1024 * 1024
"""Piece size of the chunked digest as the package records it (a 6 GB file: ~100 pieces, enough for 32 threads)."""

_local = threading.local()


class HashCancelled(Exception):
    """Raised inside a worker when another file already failed and the run stops early."""


@dataclass(frozen=True)
class HashJob:
    """One file to hash and compare.

    Attributes:
        rel: Path relative to the snapshot root (reported in errors).
        path: Absolute path to open.
        kind: ``"git"`` or ``"lfs"``.
        expected: Expected lowercase hex digest (the etag); None to hash without comparing (``pair-dpo pin``).
        size: Size seen before hashing (used for scheduling and progress only, never as evidence).
    """

    rel: str
    path: Path
    kind: str
    expected: str | None
    size: int


def _buffer(chunk_size: int) -> memoryview:
    """Returns this thread's reusable buffer of ``chunk_size`` bytes."""
    view = getattr(_local, "view", None)
    if view is None or len(view) != chunk_size:
        view = memoryview(bytearray(chunk_size))
        _local.view = view
    return view


def new_hasher(kind: str, size: int) -> hashlib._Hash:
    """Returns a hash object primed for ``kind``.

    Args:
        kind: ``"git"`` (Git blob SHA-1, the header needs ``size``) or ``"lfs"`` (SHA-256).
        size: Number of content bytes that will follow.

    Raises:
        ValueError: Unknown kind.
    """
    if kind == "git":
        return hashlib.sha1(b"blob %d\0" % size)
    if kind == "lfs":
        return hashlib.sha256()
    raise ValueError(f"unknown digest kind {kind!r}")


def hash_file(
    path: str | os.PathLike[str],
    kind: str,
    *,
    chunk_size: int = CHUNK_SIZE,
    on_bytes: Callable[[int], None] | None = None,
    stop: threading.Event | None = None,
) -> tuple[str, int]:
    """Hashes one file in fixed-size chunks with bounded memory.

    Args:
        path: File to read (symlinks are followed; a FIFO or other special file is refused before it is opened
            for blocking reads, see :func:`pair_dpo_trainer.atomic.open_regular`).
        kind: ``"git"`` or ``"lfs"``.
        chunk_size: Bytes per read.
        on_bytes: Called with the number of bytes of each chunk read.
        stop: When set by another thread, hashing stops with ``HashCancelled``.

    Returns:
        ``(hex_digest, bytes_read)``. For ``"git"`` the header uses the size at open time, so a file that
        changes size while it is read cannot match its etag.

    Raises:
        OSError: The file cannot be opened or read, or is not a regular file.
        HashCancelled: ``stop`` was set.
    """
    view = _buffer(chunk_size)
    with open_regular(path, buffering=0) as f:
        info = os.fstat(f.fileno())
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        hasher = new_hasher(kind, info.st_size)
        total = 0
        while True:
            if stop is not None and stop.is_set():
                raise HashCancelled(str(path))
            n = f.readinto(view)
            if not n:
                break
            hasher.update(view[:n])
            total += n
            if on_bytes is not None:
                on_bytes(n)
    return hasher.hexdigest(), total


def default_threads(n_files: int) -> int:
    """Default worker count: one per CPU core, at most 32, at most one per file, at least 1."""
    return max(1, min(32, os.cpu_count() or 1, n_files))


def _check_one(job: HashJob, on_bytes: Callable[[int], None], stop: threading.Event) -> tuple[str, int]:
    """Hashes ``job`` and compares it to its etag; raises ``SnapshotIntegrityError`` on any failure."""
    try:
        digest, size = hash_file(job.path, job.kind, on_bytes=on_bytes, stop=stop)
    except FileNotFoundError as exc:
        raise SnapshotIntegrityError("file_missing", f"file vanished while verifying: {exc}", job.rel) from exc
    except OSError as exc:
        raise SnapshotIntegrityError("unreadable_file", f"cannot read file: {exc}", job.rel) from exc
    if job.expected is not None and digest != job.expected:
        algo = "Git blob SHA-1" if job.kind == "git" else "SHA-256"
        raise SnapshotIntegrityError(
            "hash_mismatch",
            f"{algo} of the bytes is {digest}, metadata etag is {job.expected}",
            job.rel,
        )
    return digest, size


def verify_hashes(
    jobs: Sequence[HashJob],
    *,
    threads: int | None = None,
    progress: ProgressFn | None = None,
) -> list[tuple[str, int]]:
    """Hashes every job in parallel threads and checks it against its expected digest.

    Largest files are started first (better balance across threads). On the first failure the other workers
    stop at their next chunk and that failure is raised (the smallest path among simultaneous failures); so do they
    when the waiting thread raises (``Preempted`` from a stop signal's handler).

    Args:
        jobs: Files to hash.
        threads: Worker threads; ``None`` picks ``default_threads``.
        progress: Optional ``progress(delta_bytes, total_bytes)`` callback.

    Returns:
        ``(digest, size)`` per job, in the order of ``jobs``.

    Raises:
        SnapshotIntegrityError: ``hash_mismatch``, ``file_missing`` or ``unreadable_file``.
        ValueError: ``threads`` is not positive.
    """
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    workers = default_threads(len(jobs)) if threads is None else min(threads, max(1, len(jobs)))
    total = sum(job.size for job in jobs)
    lock = threading.Lock()
    stop = threading.Event()

    def on_bytes(n: int) -> None:
        if progress is not None:
            with lock:
                progress(n, total)

    order = sorted(range(len(jobs)), key=lambda i: (-jobs[i].size, jobs[i].rel))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pair-dpo-hash") as pool:
        futures = {i: pool.submit(_check_one, jobs[i], on_bytes, stop) for i in order}
        with _stopped_on_the_way_out(stop, futures.values()):  # a stop signal raised here: workers stop too
            done, _ = wait(futures.values(), return_when=FIRST_EXCEPTION)
        failed = sorted((jobs[i].rel, f) for i, f in futures.items() if f in done and f.exception() is not None)
        if failed:
            stop.set()
            for future in futures.values():
                future.cancel()
            raise failed[0][1].exception()  # type: ignore[misc]
    return [futures[i].result() for i in range(len(jobs))]


@contextlib.contextmanager
def _stopped_on_the_way_out(stop: threading.Event, futures: Iterable[Future]) -> Iterator[None]:
    """While the caller waits for the hashing threads: an exception raised in the wait (``Preempted`` from a stop
    signal's handler, ``KeyboardInterrupt``) sets ``stop`` and cancels the files not started, so the pool's shutdown
    waits for one chunk per thread, not for every file to be hashed."""
    try:
        yield
    except BaseException:
        stop.set()
        for future in futures:
            future.cancel()
        raise


def combine_chunk_digests(digests: Sequence[bytes], size: int, chunk_bytes: int) -> str:
    """The :data:`CHUNKED_FORMAT` hex digest of a file of ``size`` bytes whose pieces have the SHA-256 ``digests``."""
    hasher = hashlib.sha256(f"{CHUNKED_FORMAT} {chunk_bytes} {size}\n".encode())
    for digest in digests:
        hasher.update(digest)
    return hasher.hexdigest()


class ChunkedSha256:
    """The :data:`CHUNKED_FORMAT` digest of bytes fed in order (``update``), e.g. as a file is written.

    Args:
        chunk_bytes: Piece size (:data:`DIGEST_CHUNK_BYTES`).
    """

    def __init__(self, chunk_bytes: int = DIGEST_CHUNK_BYTES) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.size = 0
        self._piece = hashlib.sha256()
        self._filled = 0
        self._digests: list[bytes] = []

    def update(self, data: Any) -> None:
        """Feeds the next bytes (any buffer)."""
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self.chunk_bytes - self._filled)
            self._piece.update(view[:take])
            self._filled += take
            self.size += take
            view = view[take:]
            if self._filled == self.chunk_bytes:
                self._digests.append(self._piece.digest())
                self._piece, self._filled = hashlib.sha256(), 0

    def hexdigest(self) -> str:
        """The digest of every byte fed so far."""
        tail = [self._piece.digest()] if self._filled or not self._digests else []
        return combine_chunk_digests([*self._digests, *tail], self.size, self.chunk_bytes)

    def record(self) -> dict[str, Any]:
        """What a manifest records: ``{"format", "chunk_bytes", "digest"}`` (checked by :func:`digest_per_record`)."""
        return {"format": CHUNKED_FORMAT, "chunk_bytes": self.chunk_bytes, "digest": self.hexdigest()}


def chunked_file_digest(
    path: str | os.PathLike[str], *, chunk_bytes: int = DIGEST_CHUNK_BYTES, threads: int | None = None
) -> tuple[str, int]:
    """The :data:`CHUNKED_FORMAT` digest of a file, its pieces hashed in parallel threads (``os.preadv`` into each
    thread's reusable buffer: bounded memory, no shared file offset).

    Args:
        path: The file.
        chunk_bytes: Piece size the digest was recorded with.
        threads: Worker threads; None: :func:`default_threads` of the number of pieces.

    Returns:
        ``(hex_digest, size)``; the size is the one seen at open time.

    Raises:
        OSError: The file cannot be read, is not a regular file, or shrank while it was read.
    """
    with open_regular(path, buffering=0) as f:
        info = os.fstat(f.fileno())
        size, fd = info.st_size, f.fileno()
        pieces = max(1, math.ceil(size / chunk_bytes))

        stop = threading.Event()

        def piece(index: int) -> bytes:
            hasher, view = hashlib.sha256(), _buffer(min(CHUNK_SIZE, chunk_bytes))
            offset, end = index * chunk_bytes, min(size, (index + 1) * chunk_bytes)
            while offset < end:
                if stop.is_set():
                    raise HashCancelled(str(path))
                n = os.preadv(fd, [view[: min(len(view), end - offset)]], offset)
                if not n:
                    raise OSError(f"{path} shrank while it was hashed")
                hasher.update(view[:n])
                offset += n
            return hasher.digest()

        workers = default_threads(pieces) if threads is None else max(1, min(threads, pieces))
        if workers == 1:
            digests = [piece(i) for i in range(pieces)]
        else:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pair-dpo-hash") as pool:
                futures = [pool.submit(piece, i) for i in range(pieces)]
                with _stopped_on_the_way_out(stop, futures):
                    digests = [future.result() for future in futures]
    return combine_chunk_digests(digests, size, chunk_bytes), size


def is_digest_record(record: Any) -> bool:
    """True for a :meth:`ChunkedSha256.record` (of :data:`CHUNKED_FORMAT`, a positive piece size, a digest)."""
    return (
        isinstance(record, dict)
        and record.get("format") == CHUNKED_FORMAT
        and isinstance(record.get("chunk_bytes"), int)
        and record["chunk_bytes"] >= 1
        and isinstance(record.get("digest"), str)
    )


def digest_per_record(path: str | os.PathLike[str], record: Any, *, threads: int | None = None) -> tuple[str, int]:
    """The digest of ``path`` computed the way ``record`` (a :meth:`ChunkedSha256.record`) says.

    Returns:
        ``(hex_digest, size)``: compare the digest with ``record["digest"]``.

    Raises:
        ValueError: ``record`` is not a digest record of :data:`CHUNKED_FORMAT`.
        OSError: As :func:`chunked_file_digest`.
    """
    if not is_digest_record(record):
        raise ValueError(f"not a {CHUNKED_FORMAT} digest record: {record!r}")
    return chunked_file_digest(path, chunk_bytes=record["chunk_bytes"], threads=threads)


def sha256_files(root: str | os.PathLike[str], names: Sequence[str], *, threads: int | None = None) -> dict[str, str]:
    """The SHA-256 (lowercase hex) of each file ``root/name``, hashed in parallel threads (each file read once).

    Args:
        root: The directory the names are relative to.
        names: Relative paths of regular files.
        threads: Worker threads; ``None`` picks ``default_threads``.

    Returns:
        ``name -> hex digest`` for every name.

    Raises:
        SnapshotIntegrityError: ``file_missing`` or ``unreadable_file`` (the name is the error's ``path``).
    """
    base = Path(root)
    jobs = [HashJob(rel=name, path=base / name, kind="lfs", expected=None, size=_size(base / name)) for name in names]
    digests = verify_hashes(jobs, threads=threads)
    return {job.rel: digest for job, (digest, _) in zip(jobs, digests, strict=True)}


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0  # reported by the hash itself (file_missing / unreadable_file)
