"""Token ids the model can embed: every id of every pair a whole number in ``[0, vocab_size)``, checked before training.

An id outside the model's input embedding is an ``IndexError`` on CPU and a device-side assert on GPU, deep in the
first forward pass that meets it, naming no row. Ids come from the run's tokenizer (which may hold added tokens the
embedding lacks), from a pre-tokenised dataset, a ``prepare-data`` split or a cache entry (tokenised by another
tokenizer). :func:`check_token_ids` reads each id column once, vectorised (``pyarrow.compute`` min / max per batch of
rows; the offending row is looked for only in a batch that holds one), and names the first offending row.

Details: data/README.md, "Module notes", ``token_ids.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pair_dpo_trainer.data.arrow import is_arrow_dataset, scan
from pair_dpo_trainer.data.tokenize import FEATURE_COLUMNS
from pair_dpo_trainer.errors import ConfigError

CHECK_ROWS = 65536
"""Rows per batch read by :func:`check_token_ids`."""


def input_vocab_size(model: Any) -> int:
    """Rows of ``model``'s input embedding (``get_input_embeddings()``): the ids it can embed, which may be more than
    the tokenizer's length (embeddings padded to a multiple) or fewer (tokens added without resizing)."""
    embedding = model.get_input_embeddings()
    rows = getattr(embedding, "num_embeddings", None)
    return int(rows if rows is not None else embedding.weight.shape[0])


def check_token_ids(pairs: Any, vocab_size: int, desc: str) -> None:
    """Raises ``bad_token_id`` for the first pair of ``pairs`` holding an id outside ``[0, vocab_size)``.

    Args:
        pairs: Tokenised pairs: a ``datasets.Dataset`` (read in batches of :data:`CHECK_ROWS` rows, through its
            indices mapping if any) or a sequence of feature dicts, with the ``*_input_ids`` columns.
        vocab_size: Rows of the model's input embedding (:func:`input_vocab_size`).
        desc: Name of the dataset in the message (``"train dataset"``).

    Raises:
        ConfigError: ``bad_token_id`` naming the row (0-based index into ``pairs``), the column, the id and the range.
    """
    start = 0
    for table in _tables(pairs):
        found = [(row, col, value) for col in FEATURE_COLUMNS for row, value in _first_bad(table[col], vocab_size)]
        if found:
            row, column, value = min(found)
            raise ConfigError(
                "bad_token_id",
                f"{desc} row {start + row}: {column} holds token id {value}, outside [0, {vocab_size}), the ids the "
                f"model's input embedding has rows for: the rows were tokenised with another tokenizer, or the "
                "tokenizer has tokens the model's embedding lacks. Re-tokenise the data with this model's tokenizer "
                "(re-run `pair-dpo prepare-data --tokenizer <this model's directory>` for a prepared directory), or "
                "resize the model's embeddings to the tokenizer (model.resize_token_embeddings(len(tokenizer))).",
            )
        start += table.num_rows


def check_whole_ids(rows: Any, desc: str) -> None:
    """Raises ``bad_token_id`` for the first pre-tokenised row holding an id that is not a whole number.

    A float id (``1.5``) would be cut to an integer where the pairs are batched, and trained on; NaN, null or text
    would fail deep in the conversion with a raw Arrow error naming no row. A whole float (``7.0``, as a JSON column
    with one float reads every value) is accepted. Arrow columns are checked vectorised, batch by batch (an integer
    column only for nulls); a Python list the same way, or row by row where its batch holds text among numbers.

    Args:
        rows: Pre-tokenised rows: a ``datasets.Dataset`` or a sequence of mappings with the ``*_input_ids`` columns.
        desc: Name of the dataset in the message (``"train dataset"``).

    Raises:
        ConfigError: ``bad_token_id`` naming the row (0-based index into ``rows``), the column and the value.
    """
    start = 0
    for batch in _id_batches(rows):
        if isinstance(batch, pa.Table):
            found = [(row, col, value) for col in FEATURE_COLUMNS for row, value in _first_not_whole(batch[col])]
        else:
            found = _first_not_whole_in_rows(batch)
        if found:
            row, column, value = min(found, key=lambda item: (item[0], FEATURE_COLUMNS.index(item[1])))
            raise ConfigError(
                "bad_token_id",
                f"{desc} row {start + row}: {column} holds {value!r}, not a token id (a whole number): fix or drop "
                "the row, or tokenise its text again.",
            )
        start += batch.num_rows if isinstance(batch, pa.Table) else len(batch)


def _id_batches(rows: Any) -> Iterator[pa.Table | list[Any]]:
    """The id columns of ``rows`` in batches: Arrow tables in the values' own types, or (a list whose values do not
    convert to one Arrow type) the rows themselves."""
    if is_arrow_dataset(rows):
        yield from scan(rows, list(FEATURE_COLUMNS), batch_rows=CHECK_ROWS)
        return
    for batch in _row_chunks(rows):
        try:
            yield pa.table({column: pa.array([row[column] for row in batch]) for column in FEATURE_COLUMNS})
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):  # text among numbers, huge ints
            yield batch


def _first_not_whole(column: pa.ChunkedArray) -> list[tuple[int, Any]]:
    """``[(row, value)]`` of the first id of a list column that is not a whole number (empty when every id is)."""
    if column.null_count:
        return [(int(pc.index(pc.is_null(column), True).as_py()), None)]  # the row has no ids at all
    values = pc.list_flatten(column)
    if len(values) == 0:
        return []
    if pa.types.is_integer(values.type):
        if values.null_count == 0:
            return []
        bad = pc.is_null(values)
    elif pa.types.is_floating(values.type):
        whole = pc.and_(pc.is_finite(values), pc.equal(pc.floor(values), values))
        bad = pc.invert(pc.fill_null(whole, False))
    else:
        bad = pa.array(np.ones(len(values), dtype=bool))  # text, booleans, nested lists: no value is a token id
    position = pc.index(bad, True).as_py()
    if position < 0:
        return []
    return [(int(pc.list_parent_indices(column)[position].as_py()), values[position].as_py())]


def _first_not_whole_in_rows(rows: list[Any]) -> list[tuple[int, str, Any]]:
    """``[(row, column, value)]`` of the first id of ``rows`` that is not a whole number, read value by value."""
    for index, row in enumerate(rows):
        for column in FEATURE_COLUMNS:
            ids = row[column]
            for value in [None] if ids is None else ids:
                whole = (
                    isinstance(value, (int, np.integer)) and not isinstance(value, bool) and -(2**63) <= value < 2**63
                )
                if not (whole or (isinstance(value, float) and value.is_integer())):
                    return [(index, column, value)]
    return []


def _tables(pairs: Any) -> Iterator[pa.Table]:
    """The id columns of ``pairs`` as Arrow tables of consecutive rows."""
    if is_arrow_dataset(pairs):
        yield from scan(pairs, list(FEATURE_COLUMNS), batch_rows=CHECK_ROWS)
        return
    ids_type = pa.list_(pa.int64())
    for rows in _row_chunks(pairs):
        yield pa.table({column: pa.array([row[column] for row in rows], type=ids_type) for column in FEATURE_COLUMNS})


def _row_chunks(rows: Any) -> Iterator[list[Any]]:
    """A sequence of rows in lists of :data:`CHECK_ROWS` consecutive rows (the batches of both checks)."""
    for begin in range(0, len(rows), CHECK_ROWS):
        yield [rows[i] for i in range(begin, min(begin + CHECK_ROWS, len(rows)))]


def _first_bad(column: pa.ChunkedArray, vocab_size: int) -> list[tuple[int, int]]:
    """``[(row, id)]`` of the first id outside ``[0, vocab_size)`` in a list column (empty when every id is in)."""
    values = pc.list_flatten(column)
    if len(values) == 0:
        return []
    bounds = pc.min_max(values)
    if bounds["min"].as_py() >= 0 and bounds["max"].as_py() < vocab_size:
        return []
    outside = pc.fill_null(pc.or_(pc.less(values, 0), pc.greater_equal(values, vocab_size)), False)
    position = int(np.flatnonzero(outside.to_numpy(zero_copy_only=False))[0])
    parents = pc.list_parent_indices(column)
    return [(int(parents[position].as_py()), int(values[position].as_py()))]
