"""One chunk of rows -> tokenised pairs as an Arrow record batch, and the tally of every chunk in input order.

A :class:`PairConverter` is what each worker runs (:func:`~pair_dpo_trainer.data.workers.ordered_map`): it reads
the chunk's rows (:func:`~pair_dpo_trainer.data.streams.chunk_rows`), converts them with the package's one row
conversion (:func:`~pair_dpo_trainer.data.tokenize.tokenize_dataset` for raw rows,
:func:`~pair_dpo_trainer.data.tokenize.truncate_dataset` for pre-tokenised ones; never strict, so the chunk's
rejections come back counted) and encodes the accepted rows as one record batch (an :class:`Encoder`). Row numbers in
messages are global (the chunk's ``start`` is added), so a chunk's messages are the sequential ones.

:class:`Tally` adds the chunks' results up in chunk order: counts per reason code, the first example per code and the
first rejection of the whole input, exactly what one sequential pass gives. In a strict conversion it raises the
first rejected row (in input order) as soon as its chunk is tallied.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from pair_dpo_trainer.data.arrow import ids_array
from pair_dpo_trainer.data.rownames import RowNames
from pair_dpo_trainer.data.streams import Chunk, chunk_rows
from pair_dpo_trainer.data.tokenize import FEATURE_COLUMNS, TokenizationResult, tokenize_dataset, truncate_dataset
from pair_dpo_trainer.data.workers import ordered_map
from pair_dpo_trainer.errors import PreferenceRowError

IDS_SCHEMA = pa.schema([(column, pa.list_(pa.int32())) for column in FEATURE_COLUMNS])
"""The columns of a pair file the trainer tokenised: the three token-id columns."""

Encoder = Callable[[TokenizationResult, Chunk, Any], pa.RecordBatch]
"""``encode(result, chunk, source) -> batch`` of the chunk's accepted rows (``result.row_indices`` order)."""


def encode_ids(result: TokenizationResult, chunk: Chunk, source: Any) -> pa.RecordBatch:
    """The accepted rows' three token-id columns (:data:`IDS_SCHEMA`)."""
    arrays = [ids_array([features[column] for features in result.features]) for column in FEATURE_COLUMNS]
    return pa.RecordBatch.from_arrays(arrays, schema=IDS_SCHEMA)


@dataclass(frozen=True)
class KeepColumns:
    """Encoder for pre-tokenised ``datasets.Dataset`` rows: each accepted row with all its columns, the token-id
    columns replaced by the converted ones (cast to the source's types).

    Attributes:
        schema: The source's Arrow schema (``dataset.features.arrow_schema``).
    """

    schema: pa.Schema

    def __call__(self, result: TokenizationResult, chunk: Chunk, source: Any) -> pa.RecordBatch:
        table = source.with_format("arrow")[chunk.payload.start : chunk.payload.stop]
        table = table.take(pa.array(result.row_indices, type=pa.int64()))
        for column in FEATURE_COLUMNS:
            position = table.schema.get_field_index(column)
            values = ids_array([features[column] for features in result.features])
            table = table.set_column(position, self.schema.field(column), values.cast(self.schema.field(column).type))
        batches = table.cast(self.schema).combine_chunks().to_batches()
        return batches[0] if batches else pa.RecordBatch.from_pylist([], schema=self.schema)


@dataclass(frozen=True)
class ChunkResult:
    """What one chunk gave.

    Attributes:
        index: The chunk's number.
        num_rows: Rows read.
        batch: The accepted rows, encoded.
        rejections: Rejected rows per reason code.
        examples: The chunk's first message per reason code.
        first_error: ``(reason_code, message)`` of its first rejected row, else None.
        num_truncated: Accepted pairs that were cut to the limits.
        renderings: Accepted rows per rendering (``data.tokenize.RENDERINGS``; empty for pre-tokenised rows).
    """

    index: int
    num_rows: int
    batch: pa.RecordBatch
    rejections: Counter[str]
    examples: dict[str, str]
    first_error: tuple[str, str] | None
    num_truncated: int
    renderings: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class PairConverter:
    """Converts one :class:`~pair_dpo_trainer.data.streams.Chunk` (see the module docstring); runs in a worker.

    Attributes:
        tokenizer: The tokenizer of raw rows; None converts pre-tokenised rows (truncation and checks only).
        limits: ``max_length`` / ``max_prompt_length`` / the budget keyword of
            :func:`~pair_dpo_trainer.data.tokenize.tokenize_pair`.
        desc: Prefix of the row names in messages (e.g. ``"train dataset"``, an input file name).
        first_row: Number of the input's first row in messages (0: an index into a dataset, 1: a file's row).
        encode: The :data:`Encoder` of the accepted rows.
        keep_pairs: The encoder needs the normalised pairs (``result.pairs``).
        source: The dataset that :class:`~pair_dpo_trainer.data.streams.RowRange` chunks index into.
        apply_chat_template_to_strings: Render plain-string rows with the chat template (else raw text).
        row_names: Names the rows by their file and line in messages (``data.rownames``), else ``desc row index``.
    """

    tokenizer: Any
    limits: Mapping[str, Any]
    desc: str
    first_row: int = 0
    encode: Encoder = encode_ids
    keep_pairs: bool = False
    source: Any = field(default=None, compare=False)
    apply_chat_template_to_strings: bool = False
    row_names: RowNames | None = field(default=None, compare=False)

    def __call__(self, chunk: Chunk) -> ChunkResult:
        rows = chunk_rows(chunk.payload, self.source)
        options: dict[str, Any] = {
            "strict": False,
            "progress": False,
            "desc": self.desc,
            "first_row": self.first_row + chunk.start,
            "row_names": self.row_names,
        }
        if self.tokenizer is None:
            result = truncate_dataset(rows, **self.limits, **options)
        else:
            result = tokenize_dataset(
                rows,
                self.tokenizer,
                **self.limits,
                keep_pairs=self.keep_pairs,
                apply_chat_template_to_strings=self.apply_chat_template_to_strings,
                **options,
            )
        return ChunkResult(
            index=chunk.index,
            num_rows=result.num_rows,
            batch=self.encode(result, chunk, self.source),
            rejections=result.rejections,
            examples=result.examples,
            first_error=result.first_error,
            num_truncated=result.num_truncated,
            renderings=result.renderings,
        )


@dataclass
class Tally:
    """The sum of chunk results in chunk order (see the module docstring).

    Attributes:
        strict: Raise the first rejected row as a :class:`PreferenceRowError` (its message names the row).
    """

    strict: bool = False
    num_rows: int = 0
    num_accepted: int = 0
    num_truncated: int = 0
    rejections: Counter[str] = field(default_factory=Counter)
    renderings: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    first_error: tuple[str, str] | None = None
    started: float = field(default_factory=time.perf_counter)

    def add(self, result: ChunkResult) -> None:
        """Counts one chunk's result (the next in order).

        Raises:
            PreferenceRowError: In a strict tally, the chunk's first rejected row.
        """
        if self.strict and result.first_error is not None:
            raise PreferenceRowError(*result.first_error)
        self.num_rows += result.num_rows
        self.num_accepted += result.batch.num_rows
        self.num_truncated += result.num_truncated
        self.rejections.update(result.rejections)
        self.renderings.update(result.renderings)
        for code, message in result.examples.items():
            self.examples.setdefault(code, message)
        self.first_error = self.first_error or result.first_error

    @property
    def first_rejection(self) -> str | None:
        """``"[code] message"`` of the first rejected row, else None."""
        return None if self.first_error is None else f"[{self.first_error[0]}] {self.first_error[1]}"

    def rate(self) -> str:
        """``"N rows in T s (R rows/s)"`` since the tally started."""
        seconds = max(time.perf_counter() - self.started, 1e-9)
        return f"{self.num_rows} rows in {seconds:.1f} s ({self.num_rows / seconds:.0f} rows/s)"


def convert_chunks(
    converter: PairConverter,
    chunks: Iterable[Chunk],
    *,
    num_proc: int,
    tally: Tally,
    progress: Any = None,
) -> Iterator[ChunkResult]:
    """Yields each chunk's result in order, after adding it to ``tally`` (and advancing ``progress`` by its rows).

    Args:
        converter: What each worker runs.
        chunks: The input's chunks (consumed lazily).
        num_proc: Worker processes (1: this process).
        tally: Where the results are added up; a strict tally raises the first rejected row.
        progress: A tqdm bar (``update(rows)``), or None.
    """
    for result in ordered_map(converter, chunks, num_proc=num_proc):
        tally.add(result)
        if progress is not None:
            progress.update(result.num_rows)
        yield result
