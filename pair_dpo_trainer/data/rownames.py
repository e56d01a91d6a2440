"""Naming a row in messages by where the user can find it: its file and 1-based line, whatever split came after.

A file read for training is split into train and eval rows (whole prompt groups, in a seeded order), so a row's
index in a split says nothing about where it sits in the file. :func:`file_row_names` numbers the rows of a file once
(a JSON-lines row by its line, blank lines counted; a JSON array's item or a parquet row by its 1-based position) and
:class:`FileRows` carries those numbers with the rows of each split, so that every message about a row (a schema
error, a pair the tokenizer rejects) names ``FILE line N``. Rows passed in memory keep their 0-based index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class RowNames:
    """The names of a dataset's rows: ``names(i)`` is ``"FILE line N"`` (or ``"FILE row N"``) for its row ``i``.

    Attributes:
        source: The file as the user named it.
        unit: ``"line"`` (JSON lines) or ``"row"`` (a JSON array's item, a parquet row).
        numbers: ``int64 [rows]``: each row's 1-based line (or position) in ``source``.
    """

    source: str
    unit: str
    numbers: np.ndarray = field(compare=False)

    def __call__(self, index: int) -> str:
        return f"{self.source} {self.unit} {int(self.numbers[index])}"

    def subset(self, indices: Sequence[int]) -> RowNames:
        """The names of the rows ``indices`` (in that order)."""
        return RowNames(self.source, self.unit, self.numbers[np.asarray(indices, np.int64)])


class FileRows(list):
    """A list of rows read from a file, with their :class:`RowNames` (``row_names``), in any order or subset."""

    row_names: RowNames

    def __init__(self, rows: Sequence[Any], row_names: RowNames) -> None:
        super().__init__(rows)
        if len(row_names.numbers) != len(rows):
            raise ValueError(f"{len(rows)} rows but {len(row_names.numbers)} row names")
        self.row_names = row_names


def file_row_names(path: str | Path, num_rows: int) -> RowNames:
    """The names of the ``num_rows`` rows read from ``path`` in file order (``data.readers.load_rows``).

    A JSON-lines file (``.jsonl`` / ``.ndjson``, or a ``.json`` file that is not one JSON array) names each row by its
    line: both readers skip blank lines, so row ``i`` is the ``i``-th non-blank line. Anything else (a JSON array, a
    parquet file, a file whose non-blank lines are not its rows) names each row by its 1-based position.
    """
    source = str(path)
    positions = np.arange(1, num_rows + 1, dtype=np.int64)
    if Path(path).suffix.lower() not in (".jsonl", ".ndjson", ".json"):
        return RowNames(source, "row", positions)
    data = Path(path).read_bytes()
    if data.lstrip()[:1] == b"[":
        return RowNames(source, "row", positions)
    lines = data.split(b"\n")
    non_blank = np.flatnonzero(np.fromiter((bool(line.strip()) for line in lines), bool, len(lines))) + 1
    if len(non_blank) != num_rows:
        return RowNames(source, "row", positions)
    return RowNames(source, "line", non_blank.astype(np.int64))


def row_name(desc: str, index: int, row_names: RowNames | None) -> str:
    """How a message names row ``index`` of the dataset ``desc``: ``"FILE line N (desc)"`` for rows of a file, else
    ``"desc row index"``.

    Example:
        >>> row_name("train dataset", 5, None)
        'train dataset row 5'
        >>> row_name("train dataset", 1, RowNames("pairs.jsonl", "line", np.array([2, 6])))
        'pairs.jsonl line 6 (train dataset)'
    """
    return f"{desc} row {index}" if row_names is None else f"{row_names(index)} ({desc})"
