"""Reading preference rows from jsonl / json / parquet files for ``pair-dpo prepare-data``.

Files are read through ``datasets`` (``load_dataset("json" | "parquet", data_files=..., split="train")``)
with its cache in a caller-given temporary directory, so nothing lands in the user's HF cache and nothing
cached can change the result. Arrow needs one schema per file; a json/jsonl file whose rows Arrow cannot
hold (a line that is not an object, an empty file, ``[]``) is read again with the standard ``json`` module,
so that such rows are rejected one by one (reason code ``schema``) instead of failing the whole file.

Details: data/README.md, "Module notes", ``readers.py``.
"""

from __future__ import annotations

import codecs
import hashlib
import itertools
import json
import os
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from pair_dpo_trainer.data.normalize import UnreadableRow

# A UTF-16 surrogate escape in JSON text without its partner: \\uD800-\\uDBFF not followed by \\uDC00-\\uDFFF, or the
# reverse. A literal backslash before "u" can match too; that only sends the file to the exact json reader.
_LONE_SURROGATE_ESCAPE = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}"
)
_SCAN_BLOCK = 1 << 22
_ESCAPE_WINDOW = 12  # two \\uXXXX escapes: enough context on each side of a block boundary
_ROWS_PER_BATCH = 1000

FORMATS: dict[str, str] = {".jsonl": "json", ".ndjson": "json", ".json": "json", ".parquet": "parquet"}


class InputError(Exception):
    """An input file that cannot be read (missing, unreadable, not valid JSON / parquet)."""


def input_format(path: str | os.PathLike[str]) -> str | None:
    """Returns the ``datasets`` builder of ``path`` by suffix (``"json"`` / ``"parquet"``), else None."""
    return FORMATS.get(Path(path).suffix.lower())


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Returns the sha256 hex digest of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_input(path: str) -> str:
    """Returns the ``datasets`` builder of an input file (``"json"`` / ``"parquet"``) once it is a readable file.

    Raises:
        InputError: An unsupported suffix, a directory, a missing or unreadable file.
    """
    fmt = input_format(path)
    if fmt is None:
        raise InputError(f"{path}: unsupported input format; use {', '.join(sorted(FORMATS))} files.")
    if os.path.isdir(path):
        raise InputError(f"{path}: is a directory; pass the data files inside it.")
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such file.")
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as exc:
        raise InputError(f"{path}: cannot open it ({exc.strerror or exc}).") from exc
    return fmt


def load_rows(path: str, cache_dir: str) -> Sequence[Any]:
    """Loads every row of one input file, in file order.

    Args:
        path: A ``.jsonl`` / ``.ndjson`` / ``.json`` (array of rows or JSON lines) or ``.parquet`` file.
        cache_dir: Temporary directory for the ``datasets`` cache (the caller removes it).

    Returns:
        A ``datasets.Dataset`` or a list of decoded JSON values (one per row).

    Raises:
        InputError: The file is missing, unreadable, or not valid for its format.
    """
    fmt = check_input(path)
    if fmt == "json" and _needs_json_module(path):
        return _load_json_values(path)
    try:
        dataset = _load_with_datasets(path, fmt, cache_dir)
    except Exception as exc:  # any failure of datasets/pyarrow: retry as plain JSON, else unreadable
        if fmt != "json":
            cause = exc.__cause__ or exc
            raise InputError(f"{path}: cannot read it as {fmt} ({type(cause).__name__}: {cause}).") from exc
        return _load_json_values(path)
    if fmt == "json" and _has_json_feature(dataset.features):
        return _load_json_values(path)
    return dataset


def iter_rows(rows: Iterable[Any], start: int = 0, stop: int | None = None) -> Iterator[Any]:
    """Yields the rows of ``rows`` (those of ``[start, stop)`` when given); a ``datasets.Dataset`` row whose text does
    not decode becomes an :class:`UnreadableRow` (``bad_text``) in its place instead of ending the iteration with
    ``UnicodeDecodeError``.

    Args:
        rows: Any iterable of rows; a ``datasets.Dataset`` (python format) is read in batches of 1000 rows.
        start / stop: The row range to read (``stop=None``: to the end); a non-sequence iterable is skipped through.
    """
    datasets = sys.modules.get("datasets")  # a datasets.Dataset exists only if datasets is imported
    if datasets is None or not isinstance(rows, datasets.Dataset):
        if start == 0 and stop is None:
            yield from rows
        elif isinstance(rows, Sequence):
            yield from (rows[i] for i in range(start, len(rows) if stop is None else min(stop, len(rows))))
        else:
            yield from itertools.islice(rows, start, stop)
        return
    stop = len(rows) if stop is None else min(stop, len(rows))
    if rows.format.get("type") is not None:
        yield from (rows[i] for i in range(start, stop))
        return
    for first in range(start, stop, _ROWS_PER_BATCH):
        last = min(first + _ROWS_PER_BATCH, stop)
        try:
            batch = rows[first:last]
        except UnicodeDecodeError:
            yield from (_decoded_row(rows, i) for i in range(first, last))
            continue
        names = list(batch)
        yield from (dict(zip(names, values, strict=True)) for values in zip(*batch.values(), strict=True))


def _has_json_feature(feature: Any) -> bool:
    """True when a ``datasets`` feature (nested anywhere) is ``Json``: what ``datasets`` infers for a field whose type
    differs between rows. Its strings come back altered (``"4"`` as ``4``, ``"null"`` as ``None``)."""
    import datasets

    json_type = getattr(datasets.features, "Json", None)
    if json_type is not None and isinstance(feature, json_type):
        return True
    if isinstance(feature, dict):
        return any(_has_json_feature(value) for value in feature.values())
    if isinstance(feature, (list, tuple)):
        return any(_has_json_feature(value) for value in feature)
    inner = getattr(feature, "feature", None)  # List / Sequence / LargeList
    return inner is not None and _has_json_feature(inner)


def _decoded_row(rows: Any, index: int) -> Any:
    try:
        return rows[index]
    except UnicodeDecodeError as exc:
        return UnreadableRow("bad_text", f"its text is not valid UTF-8 ({exc.reason} at byte {exc.start}).")


def _needs_json_module(path: str) -> bool:
    """True when the file holds a lone surrogate escape or bytes that are not UTF-8: Arrow would alter such a row
    (or accept a file the ``json`` reader refuses), so it is read with the ``json`` module. Scanned in blocks."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    with open(path, "rb") as f:
        carry = b""
        while True:
            block = f.read(_SCAN_BLOCK)
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError:
                return True
            buffer = carry + block
            if not block:
                return _LONE_SURROGATE_ESCAPE.search(buffer) is not None
            # a match near the end may only lack its partner's bytes: it is judged again with the next block
            if any(m.end() + _ESCAPE_WINDOW // 2 <= len(buffer) for m in _LONE_SURROGATE_ESCAPE.finditer(buffer)):
                return True
            carry = buffer[-_ESCAPE_WINDOW:]


def _load_with_datasets(path: str, fmt: str, cache_dir: str) -> Any:
    import datasets
    from datasets.utils import logging as datasets_logging

    bars_were_enabled = datasets.is_progress_bar_enabled()
    verbosity = datasets_logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets_logging.set_verbosity(datasets_logging.CRITICAL)  # a failed Arrow parse is retried, not an error
    try:
        return datasets.load_dataset(fmt, data_files=os.path.abspath(path), split="train", cache_dir=cache_dir)
    finally:
        datasets_logging.set_verbosity(verbosity)
        if bars_were_enabled:
            datasets.enable_progress_bars()


def _load_json_values(path: str) -> list[Any]:
    """Reads a JSON-lines file, or a ``.json`` array / single value, with the ``json`` module.

    A line that is not valid JSON, or nested too deeply for the parser, becomes an :class:`UnreadableRow`
    (``bad_json``, with its line number) in its place; a line that is not UTF-8 fails the file (``InputError``: it
    is not a UTF-8 JSON-lines file).
    """
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot read it ({exc.strerror or exc}).") from exc
    if Path(path).suffix.lower() == ".json":  # a JSON document first; JSON lines if it is not one
        document = _json_document(path, data)
        if document is not None:
            return document
    rows = []
    for line_number, line in enumerate(data.split(b"\n"), start=1):
        if line.strip():
            rows.append(_json_line(path, line, line_number))
    return rows


def _json_document(path: str, data: bytes) -> list[Any] | None:
    """The rows of a whole-file JSON document, or None when the file is not one (then it is read as JSON lines)."""
    try:
        document = json.loads(codecs.decode(data, "utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    except RecursionError as exc:
        raise InputError(
            f"{path}: the JSON document nests deeper than Python's json parser allows; write the rows as JSON lines "
            "(.jsonl), one row per line, so that the bad row is counted (bad_json) and the others are read."
        ) from exc
    return document if isinstance(document, list) else [document]


def _json_line(path: str, line: bytes, line_number: int) -> Any:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{path}: line {line_number} is not UTF-8 ({exc.reason} at byte {exc.start + 1} of the line); "
            "save the file as UTF-8."
        ) from exc
    try:
        return json.loads(text)
    except RecursionError:
        return UnreadableRow(
            "bad_json", f"line {line_number} nests deeper than Python's json parser allows; flatten or drop it."
        )
    except json.JSONDecodeError as exc:  # one bad line is one bad row (bad_json), counted like any other
        return UnreadableRow("bad_json", f"line {line_number} is not valid JSON ({exc.msg}); fix or drop it.")
