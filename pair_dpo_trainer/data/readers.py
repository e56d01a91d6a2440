"""Reading preference rows from jsonl / json / parquet files for ``pair-dpo prepare-data``.

Files are read through ``datasets`` (``load_dataset("json" | "parquet", data_files=..., split="train")``)
with its cache in a caller-given temporary directory, so nothing lands in the user's HF cache and nothing
cached can change the result. Arrow needs one schema per file; a json/jsonl file whose rows Arrow cannot
hold (a line that is not an object, an empty file, ``[]``) is read again with the standard ``json`` module,
so that such rows are rejected one by one (reason code ``schema``) instead of failing the whole file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
    try:
        return _load_with_datasets(path, fmt, cache_dir)
    except Exception as exc:  # any failure of datasets/pyarrow: retry as plain JSON, else unreadable
        if fmt != "json":
            cause = exc.__cause__ or exc
            raise InputError(f"{path}: cannot read it as {fmt} ({type(cause).__name__}: {cause}).") from exc
    return _load_json_values(path)


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
    """Reads a JSON-lines file, or a ``.json`` array / single value, with the ``json`` module."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read it as UTF-8 JSON ({exc}); save the file as UTF-8.") from exc
    if Path(path).suffix.lower() == ".json":  # a JSON document first; JSON lines if it is not one
        try:
            document = json.loads(text)
        except json.JSONDecodeError:
            pass
        else:
            return document if isinstance(document, list) else [document]
    rows = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}: line {line_number} is not valid JSON ({exc.msg}); fix or drop it.") from exc
    return rows
