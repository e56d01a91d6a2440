"""What ``prepare-data`` reads and writes: candidate rows tokenised in parallel chunks, then the two splits.

Details: data/README.md, "Module notes", ``prepare_rows.py``.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pair_dpo_trainer.data.arrow import HashingFile, StreamWriter, binary_values, ids_array
from pair_dpo_trainer.data.chunks import PairConverter, Tally, convert_chunks
from pair_dpo_trainer.data.normalize import PreferencePair, prompt_hash
from pair_dpo_trainer.data.prepared import PREPARED_SCHEMA
from pair_dpo_trainer.data.splits import SPLIT_KEY_BYTES, group_keys, split_key
from pair_dpo_trainer.data.streams import Chunk, FileStream
from pair_dpo_trainer.data.tokenize import FEATURE_COLUMNS, TokenizationResult

CANDIDATES_SCHEMA = pa.schema([("json_line", pa.binary()), *PREPARED_SCHEMA, ("split_key", pa.binary(SPLIT_KEY_BYTES))])
"""The candidates file: each accepted row's output JSON line, its Arrow columns, and its prompt group's
:func:`~pair_dpo_trainer.data.splits.split_key` (computed by the workers: the split itself then only sorts)."""


@dataclass(frozen=True)
class Candidate:
    """One accepted row: where it came from (``row``: 1-based row number in its file), its pair and token ids."""

    source: str
    row: int
    pair: PreferencePair
    features: dict[str, list[int]]
    prompt_hash: str

    def to_json_row(self) -> dict[str, Any]:
        """The output row: messages, token ids, prompt hash and source."""
        return {
            **self.pair.as_row(),
            **self.features,
            "prompt_hash": self.prompt_hash,
            "source": self.source,
            "source_row": self.row,
        }


def _json_text(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True)
class CandidateRows:
    """Encoder (:data:`~pair_dpo_trainer.data.chunks.Encoder`) of one input's accepted rows as candidates.

    Attributes:
        source: The input's file name, recorded in each row.
        seed: The split's seed (of each row's ``split_key``).
    """

    source: str
    seed: int

    def __call__(self, result: TokenizationResult, chunk: Chunk, _source: Any) -> pa.RecordBatch:
        pairs = result.pairs or []
        rows = [
            Candidate(self.source, chunk.start + index + 1, pair, features, prompt_hash(pair))
            for index, pair, features in zip(result.row_indices, pairs, result.features, strict=True)
        ]
        columns = {
            "json_line": pa.array([(_json_text(c.to_json_row()) + "\n").encode("utf-8") for c in rows], pa.binary()),
            **{column: ids_array([c.features[column] for c in rows]) for column in FEATURE_COLUMNS},
            "prompt_hash": pa.array([c.prompt_hash for c in rows], pa.string()),
            "source": pa.array([c.source for c in rows], pa.string()),
            "source_row": pa.array([c.row for c in rows], pa.int64()),
            "pair": pa.array([_json_text(c.pair.as_row()) for c in rows], pa.string()),
            "split_key": pa.array([split_key(self.seed, c.prompt_hash) for c in rows], pa.binary(SPLIT_KEY_BYTES)),
        }
        return pa.RecordBatch.from_pydict(columns, schema=CANDIDATES_SCHEMA)


@dataclass(frozen=True)
class InputSummary:
    """One input file as recorded in the manifest."""

    name: str
    sha256: str
    rows: int


@dataclass
class ReadResult:
    """Every input read: the candidates file, each accepted row's prompt hash and split key (Arrow arrays, one per
    chunk: no Python object per row), the inputs and the tally."""

    candidates: Path
    prompt_hashes: list[pa.Array] = field(default_factory=list)
    split_keys: list[pa.Array] = field(default_factory=list)
    inputs: list[InputSummary] = field(default_factory=list)
    tally: Tally = field(default_factory=Tally)
    workers: int = 1

    def add(self, batch: pa.RecordBatch) -> None:
        """Records one candidates batch's prompt hashes and split keys."""
        self.prompt_hashes.append(batch.column("prompt_hash"))
        self.split_keys.append(batch.column("split_key"))

    def groups(self) -> PromptGroups:
        """The candidates' prompt groups (numbered in order of first appearance) and their split keys."""
        hashes = pa.chunked_array(self.prompt_hashes, pa.string()).combine_chunks()
        codes = pc.dictionary_encode(hashes)  # group numbers in order of first appearance
        group_of_row = codes.indices.to_numpy(zero_copy_only=False).astype(np.int64)
        num_groups = len(codes.dictionary)
        first_row = np.full(num_groups, len(group_of_row), np.int64)
        np.minimum.at(first_row, group_of_row, np.arange(len(group_of_row)))
        keys = pa.chunked_array(self.split_keys, pa.binary(SPLIT_KEY_BYTES)).combine_chunks()
        digests = keys.take(pa.array(first_row)).buffers()[1]
        return PromptGroups(group_of_row, group_keys(digests if digests is not None else b"", num_groups))


@dataclass(frozen=True)
class PromptGroups:
    """The candidates' prompt groups.

    Attributes:
        group_of_row: ``int64 [candidates]``: each candidate's group number.
        keys: ``uint64 [groups, 4]``: each group's split key (:func:`~pair_dpo_trainer.data.splits.group_keys`).
    """

    group_of_row: np.ndarray
    keys: np.ndarray

    def count(self, rows: np.ndarray | None = None) -> int:
        """The number of distinct prompts among ``rows`` (all candidates for None)."""
        if rows is None:
            return len(self.keys)
        return int(np.unique(self.group_of_row[rows]).size)


def read_inputs(
    paths: list[str],
    tokenizer: Any,
    limits: dict[str, Any],
    candidates: Path,
    *,
    seed: int,
    strict: bool,
    num_proc: int,
    progress: Callable[[str, int], Any] | None = None,
    apply_chat_template_to_strings: bool = False,
) -> ReadResult:
    """Tokenises every row of every input into the candidates file (module docstring).

    Args:
        paths: The input files, in order.
        tokenizer: The tokenizer.
        limits: The keyword limits of :func:`~pair_dpo_trainer.data.tokenize.tokenize_pair`.
        candidates: The candidates file to write (scratch: not fsynced).
        seed: The split's seed (each row's ``split_key``).
        strict: Raise the first rejected row (its ``PreferenceRowError``) instead of counting it.
        num_proc: Worker processes.
        progress: ``progress(name, total_rows)`` -> a tqdm bar for one input, or None for no bars.
        apply_chat_template_to_strings: Render plain-string rows with the chat template (else raw text).

    Raises:
        InputError: An input that cannot be read (named with the line where it applies).
        PreferenceRowError: With ``strict``, the first rejected row.
    """
    read = ReadResult(candidates, tally=Tally(strict=strict))
    with StreamWriter(candidates, CANDIDATES_SCHEMA, durable=False) as writer:
        for path in paths:
            name = Path(path).name
            stream = FileStream(path)
            chunks = stream.chunks()
            head = list(itertools.islice(chunks, 2))
            read.workers = max(read.workers, num_proc if len(head) > 1 else 1)
            encode = CandidateRows(name, seed)
            converter = PairConverter(
                tokenizer,
                limits,
                name,
                first_row=1,
                encode=encode,
                keep_pairs=True,
                apply_chat_template_to_strings=apply_chat_template_to_strings,
            )
            bar = progress(name, stream.expected_rows()) if progress is not None else None
            try:
                for result in convert_chunks(
                    converter, itertools.chain(head, chunks), num_proc=num_proc, tally=read.tally, progress=bar
                ):
                    writer.write(result.batch)
                    read.add(result.batch)
            finally:
                if bar is not None:
                    bar.close()
            read.inputs.append(InputSummary(name=name, sha256=stream.sha256 or "", rows=stream.rows))
    return read


def write_splits(directory: Path, read: ReadResult, assignment: dict[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    """Writes ``<split>.jsonl`` and ``<split>.arrow`` for each split of ``assignment`` (candidate numbers).

    Rows are written in input order, one batch of the candidates file at a time.

    Returns:
        ``{file name: {"rows": n, "sha256": hex}}`` for the manifest's ``outputs``; an Arrow file's entry also has
        ``digest``, its chunked digest (``integrity.hashing.ChunkedSha256.record``), checked before it is trained on.
    """
    split_of = np.full(read.tally.num_accepted, -1, dtype=np.int8)
    names = list(assignment)
    for number, name in enumerate(names):
        split_of[np.asarray(assignment[name], dtype=np.int64)] = number
    writers = {name: _SplitWriter(directory, name) for name in names}
    try:
        start = 0
        with pa.OSFile(str(read.candidates)) as source:  # read batch by batch: no page of it stays in this process
            for batch in pa.ipc.open_stream(source):
                mine = split_of[start : start + batch.num_rows]
                start += batch.num_rows
                for number, name in enumerate(names):
                    writers[name].write(batch.filter(pa.array(mine == number)))
    finally:
        outputs = {}
        for writer in writers.values():
            outputs.update(writer.close())
    return outputs


class _SplitWriter:
    """The ``.jsonl`` and ``.arrow`` file of one split, written together."""

    def __init__(self, directory: Path, name: str) -> None:
        self.name = name
        self.rows = 0
        self._jsonl = HashingFile(directory / f"{name}.jsonl")
        self._arrow = StreamWriter(directory / f"{name}.arrow", PREPARED_SCHEMA)

    def write(self, batch: pa.RecordBatch) -> None:
        if not batch.num_rows:
            return
        self._jsonl.write(binary_values(batch.column("json_line")))
        self._arrow.write(batch.select(PREPARED_SCHEMA.names))
        self.rows += batch.num_rows

    def close(self) -> dict[str, dict[str, Any]]:
        self._jsonl.close()
        arrow = self._arrow.close()
        return {
            f"{self.name}.jsonl": {"rows": self.rows, "sha256": self._jsonl.hexdigest()},
            f"{self.name}.arrow": {"rows": arrow.rows, "sha256": arrow.sha256, "digest": arrow.digest},
        }
