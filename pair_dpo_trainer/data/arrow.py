"""Tokenised pairs in Arrow: the columns, writing them as an Arrow stream file, memory-mapping them, their lengths.

Every dataset the trainer builds (raw rows it tokenised, pre-tokenised rows it had to cut, ``prepare-data``
directories) lives in an Arrow IPC stream file that ``datasets.Dataset.from_file`` memory-maps: token ids cost 4 bytes
each on disk and nothing in the process until a row is read (the page cache is shared by every rank of the node),
instead of ~25 bytes per id in Python lists on every rank. The token columns are ``list<int32>``.

Reading without materialising: :func:`arrow_lengths` and :func:`content_fingerprint` walk a dataset in batches of
:data:`SCAN_ROWS` rows, so their memory does not grow with the dataset (a dataset with an indices mapping, from
``select`` or ``shuffle``, is read through it).
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pair_dpo_trainer.integrity.hashing import ChunkedSha256

IDS_TYPE = pa.list_(pa.int32())
"""Arrow type of a token-id column."""

SCAN_ROWS = 8192
"""Rows per batch when a dataset is scanned (lengths, fingerprints)."""

CHILD_HASH_BYTES = 64 * 1024 * 1024
"""Above this many bytes of Arrow data, :func:`content_fingerprint` reads the dataset in a forked child."""


@dataclass(frozen=True)
class StreamFile:
    """An Arrow stream file just written.

    Attributes:
        rows: Rows written.
        size: Bytes of the file.
        sha256: SHA-256 of the file's bytes.
        digest: Its chunked digest as a manifest records it (``integrity.hashing.ChunkedSha256.record``; empty for
            a scratch file): what a reader checks the file against, on every core.
    """

    rows: int
    size: int
    sha256: str
    digest: dict[str, Any]


class HashingFile:
    """A binary file that hashes what is written to it (SHA-256 and the chunked digest) and is fsynced on close
    (pyarrow writes through ``write``); ``durable=False``: neither hashed nor fsynced (a scratch file).

    Args:
        path: The file (created or replaced).
        durable: Hash and fsync.
    """

    def __init__(self, path: str | os.PathLike[str], durable: bool = True) -> None:
        self._file = open(path, "wb")  # noqa: SIM115 - closed by close()
        self._digest = hashlib.sha256() if durable else None
        self._chunked = ChunkedSha256() if durable else None
        self.size = 0
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if self._digest is not None:
            self._digest.update(view)
        if self._chunked is not None:
            self._chunked.update(view)
        self.size += view.nbytes
        return self._file.write(view)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self.closed:
            self._file.flush()
            if self._digest is not None:
                os.fsync(self._file.fileno())
            self._file.close()
            self.closed = True

    def hexdigest(self) -> str:
        return "" if self._digest is None else self._digest.hexdigest()

    def digest_record(self) -> dict[str, Any]:
        """The chunked digest's record (``integrity.hashing.ChunkedSha256.record``; empty when not durable)."""
        return {} if self._chunked is None else self._chunked.record()


class StreamWriter:
    """Writes record batches of one schema to an Arrow stream file, hashing the bytes as they go.

    Args:
        path: The file (created or replaced).
        schema: The schema of every batch.
        durable: Hash the bytes and fsync on close (False, for a scratch file read back once by this process: neither;
            ``result.sha256`` is then empty).

    Example:
        >>> with StreamWriter(path, schema) as writer:  # doctest: +SKIP
        ...     writer.write(batch)
        >>> writer.result.rows  # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike[str], schema: pa.Schema, *, durable: bool = True) -> None:
        self._sink = HashingFile(path, durable)
        self._writer = pa.ipc.new_stream(self._sink, schema)
        self._rows = 0
        self.result: StreamFile | None = None

    def write(self, batch: pa.RecordBatch | pa.Table) -> None:
        """Appends the rows of ``batch`` (a table is written batch by batch)."""
        if batch.num_rows:
            self._writer.write(batch)
            self._rows += batch.num_rows

    def close(self) -> StreamFile:
        """Ends the stream, fsyncs and closes the file; returns (and keeps in ``result``) what was written."""
        if self.result is None:
            self._writer.close()
            self._sink.close()
            self.result = StreamFile(self._rows, self._sink.size, self._sink.hexdigest(), self._sink.digest_record())
        return self.result

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_stream(path: str | os.PathLike[str], schema: pa.Schema, batches: Iterable[pa.RecordBatch]) -> StreamFile:
    """Writes ``batches`` to ``path`` as one Arrow stream file; returns its row count, size and digests."""
    with StreamWriter(path, schema) as writer:
        for batch in batches:
            writer.write(batch)
    return writer.close()


def ids_array(sequences: Sequence[Sequence[int]]) -> pa.Array:
    """A ``list<int32>`` array of token-id sequences (ids must fit in int32: every vocabulary does)."""
    return pa.array(sequences, type=IDS_TYPE)


def binary_values(array: pa.Array) -> memoryview:
    """The concatenated values of a ``binary`` array without nulls, as one view of its data buffer (no Python object per
    value: the bytes ``b"".join(array.to_pylist())`` would build)."""
    if array.null_count:
        raise ValueError("binary_values: the array has nulls")
    if not len(array):
        return memoryview(b"")
    offsets = np.frombuffer(array.buffers()[1], dtype=np.int32, count=array.offset + len(array) + 1)
    data = array.buffers()[2]
    return memoryview(data)[int(offsets[array.offset]) : int(offsets[-1])]


def open_arrow(path: str | os.PathLike[str]) -> Any:
    """The Arrow stream file at ``path`` as a memory-mapped ``datasets.Dataset`` (nothing is read into memory)."""
    import datasets

    return datasets.Dataset.from_file(str(path), in_memory=False)


def is_arrow_dataset(rows: Any) -> bool:
    """True for a ``datasets.Dataset`` (Arrow-backed; ``datasets`` need not be imported to answer False)."""
    import sys

    datasets = sys.modules.get("datasets")
    return datasets is not None and isinstance(rows, datasets.Dataset)


def scan(dataset: Any, columns: Sequence[str] | None = None, batch_rows: int = SCAN_ROWS) -> Iterator[pa.Table]:
    """Yields ``dataset`` (a ``datasets.Dataset``) as Arrow tables of at most ``batch_rows`` rows, in order.

    Only ``columns`` are read (all when None); a dataset without an indices mapping is sliced without copying.
    """
    view = dataset if columns is None else dataset.select_columns(list(columns))
    view = view.with_format("arrow")
    for start in range(0, len(view), batch_rows):
        yield view[start : start + batch_rows]


def arrow_lengths(dataset: Any, column: str) -> np.ndarray:
    """``[N]`` int64: the length of each row's list in ``column`` of a ``datasets.Dataset``, read in batches."""
    parts = [pc.list_value_length(table[column]).to_numpy(zero_copy_only=False) for table in scan(dataset, [column])]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


def content_fingerprint(dataset: Any) -> str:
    """SHA-256 of a ``datasets.Dataset``'s rows: its schema and its rows as Arrow IPC, batch by batch.

    Equal fingerprints mean equal rows (IPC is a lossless encoding of the values, nulls and types); a change in any
    value, row, column or type changes it. The same rows stored differently (other chunking, another Arrow version)
    may give another fingerprint: a cache keyed by it then misses, it never returns another dataset's result.

    A dataset of more than :data:`CHILD_HASH_BYTES` is read by a forked child process: the pages of a memory-mapped
    dataset that the hashing reads then count in the child's memory, not in this process's (every rank computes the
    fingerprint of a raw dataset that only its node's local main converts).
    """
    inline = "fork" not in multiprocessing.get_all_start_methods() or multiprocessing.current_process().daemon
    if inline or dataset.data.nbytes <= CHILD_HASH_BYTES:
        return _content_fingerprint(dataset)
    return _in_forked_child(_content_fingerprint, dataset)


def _content_fingerprint(dataset: Any) -> str:
    digest = hashlib.sha256(b"pair_dpo_trainer.rows/1\n")
    digest.update(dataset.features.arrow_schema.serialize())
    digest.update(f"{len(dataset)}\n".encode())
    for table in scan(dataset):
        for batch in table.to_batches():
            digest.update(batch.serialize())
    return digest.hexdigest()


def _in_forked_child(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` computed in a forked child (``args`` inherited, not pickled); its exception is raised here."""
    from pair_dpo_trainer.errors import freeze_exception, thaw_exception

    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)

    def target() -> None:
        try:
            send.send((True, fn(*args)))
        except BaseException as exc:  # raised in the parent, as itself
            send.send((False, freeze_exception(exc)))

    child = context.Process(target=target, daemon=True)
    child.start()
    send.close()
    try:
        ok, value = receive.recv()
    except EOFError as exc:
        raise RuntimeError(f"the process computing {fn.__name__} died (exit code {child.exitcode})") from exc
    finally:
        child.join()
    if not ok:
        raise thaw_exception(value)
    return value
