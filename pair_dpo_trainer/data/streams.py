"""Rows in bounded chunks: an input file read as a stream, or a dataset cut into row ranges, for parallel workers.

A :class:`Chunk` is what one worker converts: its number, the 0-based index of its first row, and a payload that
becomes the chunk's rows in the worker (:func:`chunk_rows`):

Details: data/README.md, "Module notes", ``streams.py``.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pair_dpo_trainer.data.normalize import UnreadableRow
from pair_dpo_trainer.data.readers import (
    InputError,
    _json_document,
    _json_line,
    check_input,
    iter_rows,
    sha256_file,
)
from pair_dpo_trainer.data.workers import CHUNK_ROWS


@dataclass(frozen=True)
class Chunk:
    """One task of the parallel conversion.

    Attributes:
        index: Chunk number, from 0, in input order.
        start: 0-based index, in its input, of the chunk's first row.
        payload: :class:`JsonLines`, :class:`ArrowRows`, :class:`RowRange` or a list of rows.
    """

    index: int
    start: int
    payload: Any


@dataclass(frozen=True)
class JsonLines:
    """Non-blank raw lines of a JSON-lines file: ``(line number, bytes)`` each."""

    path: str
    lines: tuple[tuple[int, bytes], ...]


@dataclass(frozen=True)
class ArrowRows:
    """One record batch of an Arrow / parquet input."""

    batch: Any


@dataclass(frozen=True)
class RowRange:
    """Rows ``[start, stop)`` of the converter's source."""

    start: int
    stop: int


def chunk_rows(payload: Any, source: Any = None) -> list[Any]:
    """The rows of one chunk's payload, decoded in the worker (see the module docstring)."""
    if isinstance(payload, JsonLines):
        return [_json_line(payload.path, line, number) for number, line in payload.lines]
    if isinstance(payload, ArrowRows):
        return _batch_rows(payload.batch)
    if isinstance(payload, RowRange):
        return list(iter_rows(source, payload.start, payload.stop))
    return list(payload)


def _batch_rows(batch: Any) -> list[Any]:
    try:
        return batch.to_pylist()
    except UnicodeDecodeError:
        return [_batch_row(batch, i) for i in range(batch.num_rows)]


def _batch_row(batch: Any, index: int) -> Any:
    try:
        return batch.slice(index, 1).to_pylist()[0]
    except UnicodeDecodeError as exc:
        return UnreadableRow("bad_text", f"its text is not valid UTF-8 ({exc.reason} at byte {exc.start}).")


def range_chunks(num_rows: int, chunk_rows: int = CHUNK_ROWS) -> Iterator[Chunk]:
    """Chunks of :class:`RowRange` covering ``num_rows`` rows of an indexable source."""
    for index, start in enumerate(range(0, num_rows, chunk_rows)):
        yield Chunk(index, start, RowRange(start, min(start + chunk_rows, num_rows)))


def list_chunks(rows: Sequence[Any], chunk_rows: int = CHUNK_ROWS) -> Iterator[Chunk]:
    """Chunks holding the rows themselves (pickled to the workers)."""
    for index, start in enumerate(range(0, len(rows), chunk_rows)):
        yield Chunk(index, start, list(rows[start : start + chunk_rows]))


class FileStream:
    """The rows of one jsonl / ndjson / json / parquet file as chunks, read as they are consumed.

    Args:
        path: The input file.
        chunk_rows: Rows per chunk.

    Raises:
        InputError: On construction for a missing, unreadable or unsupported file; while iterating for a parquet file
            that cannot be read.
    """

    def __init__(self, path: str, chunk_rows: int = CHUNK_ROWS) -> None:
        self.path = path
        self.format = check_input(path)
        self.chunk_rows = chunk_rows
        self.rows = 0
        self.sha256: str | None = None
        self._document: list[Any] | None = None
        if self.format == "json" and path.lower().endswith(".json") and not self._first_line_is_a_row():
            with open(path, "rb") as f:
                self._document = _json_document(path, f.read())  # None: not one document, JSON lines after all

    def expected_rows(self) -> int:
        """The number of rows :meth:`chunks` will yield (a parquet file's metadata; the non-blank lines of a JSON-lines
        file, counted in one streamed pass), for a progress bar's total."""
        if self._document is not None:
            return len(self._document)
        if self.format == "parquet":
            return int(self._parquet_file().metadata.num_rows)
        with open(self.path, "rb") as f:
            return sum(1 for line in f if line.strip())

    def chunks(self) -> Iterator[Chunk]:
        """Yields the file's chunks in order; ``rows`` and ``sha256`` are set when the iteration ends."""
        if self.format == "parquet":
            source = self._parquet_chunks()
        elif self._document is not None:
            source = list_chunks(self._document, self.chunk_rows)
        else:
            source = self._line_chunks()
        for chunk in source:
            self.rows += _payload_rows(chunk.payload)
            yield chunk
        if self.sha256 is None:
            self.sha256 = sha256_file(self.path)

    def _first_line_is_a_row(self) -> bool:
        """True when a ``.json`` file reads the same as JSON lines: its first non-blank line alone is a JSON value
        that is not an array (a whole-file document would then be that one row, or not parse at all)."""
        with open(self.path, "rb") as f:
            for line in f:
                if line.strip():
                    try:
                        value = json.loads(line.decode("utf-8"))
                    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
                        return False
                    return not isinstance(value, list)
        return True

    def _line_chunks(self) -> Iterator[Chunk]:
        import hashlib

        digest = hashlib.sha256()
        lines: list[tuple[int, bytes]] = []
        index = start = 0
        with open(self.path, "rb") as f:
            for number, line in enumerate(f, start=1):
                digest.update(line)
                if not line.strip():
                    continue
                lines.append((number, line.rstrip(b"\n")))
                if len(lines) == self.chunk_rows:
                    yield Chunk(index, start, JsonLines(self.path, tuple(lines)))
                    index, start, lines = index + 1, start + len(lines), []
        if lines:
            yield Chunk(index, start, JsonLines(self.path, tuple(lines)))
        self.sha256 = digest.hexdigest()

    def _parquet_file(self) -> Any:
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(self.path)
        except Exception as exc:  # not a parquet file at all
            raise InputError(f"{self.path}: cannot read it as parquet ({type(exc).__name__}: {exc}).") from exc

    def _parquet_chunks(self) -> Iterator[Chunk]:
        start = 0
        batches = self._parquet_file().iter_batches(batch_size=self.chunk_rows)
        for index in itertools.count():
            try:
                batch = next(batches)
            except StopIteration:
                return
            except Exception as exc:  # a corrupt row group
                raise InputError(f"{self.path}: cannot read it as parquet ({type(exc).__name__}: {exc}).") from exc
            yield Chunk(index, start, ArrowRows(batch))
            start += batch.num_rows


def _payload_rows(payload: Any) -> int:
    if isinstance(payload, JsonLines):
        return len(payload.lines)
    if isinstance(payload, ArrowRows):
        return payload.batch.num_rows
    if isinstance(payload, RowRange):
        return payload.stop - payload.start
    return len(payload)
