"""Rows -> memory-mapped tokenised pairs: converted once per node, on every core, into the cache.

:func:`build_pairs` is what the trainer does with raw rows (a list or a ``datasets.Dataset``) and with a
pre-tokenised ``datasets.Dataset``:

Details: data/README.md, "Module notes", ``pairs.py``.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from pair_dpo_trainer.data.arrow import StreamWriter, content_fingerprint, is_arrow_dataset, open_arrow
from pair_dpo_trainer.data.cache import ARROW_FILE, CACHE_FORMAT, CacheEntry, PairCache, rows_fingerprint
from pair_dpo_trainer.data.chunks import IDS_SCHEMA, KeepColumns, PairConverter, Tally, convert_chunks, encode_ids
from pair_dpo_trainer.data.fingerprint import tokenizer_fingerprint
from pair_dpo_trainer.data.streams import range_chunks
from pair_dpo_trainer.data.workers import CHUNK_ROWS

logger = logging.getLogger(__name__)

OncePerNode = Callable[[Callable[[], Any]], tuple[Any, bool]]
"""Runs ``work`` on the node's local main only and returns ``(its result, whether this process ran it)`` on every
rank of the node. The trainer passes ``parallel.node.Node.once``; data code never learns about ranks itself."""


def in_this_process(work: Callable[[], Any]) -> tuple[Any, bool]:
    """The :data:`OncePerNode` of a single process: runs ``work`` here."""
    return work(), True


@dataclass(frozen=True)
class BuiltPairs:
    """The pairs of one dataset and how they were obtained.

    Attributes:
        dataset: A memory-mapped ``datasets.Dataset`` (or the pre-tokenised input itself when nothing was cut).
        num_rows: Pairs.
        num_truncated: Pairs cut to the limits.
        entry: The cache entry.
        here: This process converted the rows (False: a cache hit, or the node's local main converted them).
        renderings: Pairs per rendering (``data.tokenize.RENDERINGS``; empty for pre-tokenised rows).
    """

    dataset: Any
    num_rows: int
    num_truncated: int
    entry: CacheEntry
    here: bool
    renderings: Mapping[str, int] = field(default_factory=dict)


def build_pairs(
    dataset: Any,
    tokenizer: Any,
    limits: Mapping[str, Any],
    *,
    tokenized: bool,
    desc: str,
    num_proc: int,
    cache: PairCache,
    once: OncePerNode = in_this_process,
    progress: bool = False,
    apply_chat_template_to_strings: bool = False,
) -> BuiltPairs:
    """Tokenised pairs of ``dataset`` within ``limits``, converted once per node (module docstring).

    Args:
        dataset: Raw rows (a sequence, or a ``datasets.Dataset``), or a pre-tokenised ``datasets.Dataset``.
        tokenizer: The run's tokenizer (unused for pre-tokenised rows).
        limits: The keyword limits of :func:`~pair_dpo_trainer.data.tokenize.tokenize_pair`.
        tokenized: ``dataset`` has the three ``*_input_ids`` columns (it is only truncated and checked).
        desc: Name of the dataset in messages and logs.
        num_proc: Worker processes of the local main's conversion.
        cache: Where entries live.
        once: Runs the conversion once per node (who converts, who waits); default: in this process.
        progress: Show a progress bar (rows/s) on stderr while converting.
        apply_chat_template_to_strings: Render plain-string rows with the chat template (part of the cache key).

    Raises:
        PreferenceRowError: The first bad row, on every rank of the node.
        ConfigError: ``dataset_cache_unwritable``.
    """
    strings = apply_chat_template_to_strings and not tokenized
    fingerprint = _fingerprint(dataset)
    if fingerprint is None:  # rows that do not pickle (e.g. nested past the recursion limit): no cache, no sharing
        return _convert_in_memory(dataset, tokenizer, limits, tokenized=tokenized, desc=desc, strings=strings)
    key = _cache_key(fingerprint, None if tokenized else tokenizer, limits, strings=strings)
    build = functools.partial(
        _write_pairs,
        dataset,
        tokenizer,
        limits,
        tokenized=tokenized,
        desc=desc,
        num_proc=num_proc,
        progress=progress,
        strings=strings,
    )
    entry, ran_here = once(lambda: cache.get_or_build(key, build, num_proc=num_proc))
    here = ran_here and entry.built_here
    if entry.meta["key"] != json.loads(json.dumps(key)):  # this rank's rows or tokenizer differ from the main's
        entry = cache.get_or_build(key, build, num_proc=num_proc)
        here = entry.built_here
    result = entry.meta["result"]
    pairs = dataset if entry.arrow_path is None else open_arrow(entry.arrow_path)
    _log(desc, entry, here)
    renderings = result.get("renderings", {})
    return BuiltPairs(pairs, int(result["rows"]), int(result["num_truncated"]), entry, here, renderings)


def _cache_key(fingerprint: str, tokenizer: Any, limits: Mapping[str, Any], *, strings: bool) -> dict[str, Any]:
    """What a cache entry is valid for: the rows, the tokenizer, the limits and how plain strings are rendered
    (``"raw"`` text or through the ``"chat_template"``)."""
    from pair_dpo_trainer.version import __version__

    return {
        "format": CACHE_FORMAT,
        "package": __version__,
        "conversion": "truncate" if tokenizer is None else "tokenize",
        "rows": fingerprint,
        "tokenizer": None if tokenizer is None else tokenizer_fingerprint(tokenizer),
        "limits": {name: limits[name] for name in sorted(limits)},
        "strings": None if tokenizer is None else ("chat_template" if strings else "raw"),
    }


def _fingerprint(dataset: Any) -> str | None:
    """The rows' fingerprint, or None for rows that cannot be pickled (logged)."""
    if is_arrow_dataset(dataset):
        return content_fingerprint(dataset)
    try:
        return rows_fingerprint(dataset)
    except Exception as exc:  # pickle raises several types for an object it cannot serialise
        logger.warning(
            "a row cannot be pickled (%s: %s): the dataset is converted on every rank, in memory, and not cached",
            type(exc).__name__,
            exc,
        )
        return None


def _converter(dataset: Any, tokenizer: Any, limits: Mapping[str, Any], *, tokenized: bool, desc: str, strings: bool):
    """The chunk converter of ``dataset`` and the schema of what it writes."""
    names = getattr(dataset, "row_names", None)  # rows read from a file (data.rownames.FileRows)
    if tokenized:
        schema = dataset.features.arrow_schema
        converter = PairConverter(None, limits, desc, encode=KeepColumns(schema), source=dataset, row_names=names)
        return converter, schema
    converter = PairConverter(
        tokenizer,
        limits,
        desc,
        encode=encode_ids,
        source=dataset,
        apply_chat_template_to_strings=strings,
        row_names=names,
    )
    return converter, IDS_SCHEMA


def _convert_in_memory(
    dataset: Any, tokenizer: Any, limits: Mapping[str, Any], *, tokenized: bool, desc: str, strings: bool
) -> BuiltPairs:
    """Converts ``dataset`` in this process into an in-memory Arrow dataset (no cache, no workers)."""
    import datasets

    converter, schema = _converter(dataset, tokenizer, limits, tokenized=tokenized, desc=desc, strings=strings)
    tally = Tally(strict=True)
    batches = [r.batch for r in convert_chunks(converter, range_chunks(len(dataset)), num_proc=1, tally=tally)]
    pairs = datasets.Dataset(pa.Table.from_batches(batches, schema=schema))
    entry = CacheEntry(Path(), {"result": {"arrow": None}, "created_by": {}}, built_here=True)
    return BuiltPairs(pairs, tally.num_accepted, tally.num_truncated, entry, True, dict(tally.renderings))


def _write_pairs(
    dataset: Any,
    tokenizer: Any,
    limits: Mapping[str, Any],
    directory: Path,
    *,
    tokenized: bool,
    desc: str,
    num_proc: int,
    progress: bool,
    strings: bool,
) -> dict[str, Any]:
    """Converts every row into ``directory / pairs.arrow``; returns the entry's ``result`` (runs on the local main)."""
    converter, schema = _converter(dataset, tokenizer, limits, tokenized=tokenized, desc=desc, strings=strings)
    chunks = range_chunks(len(dataset))
    workers = max(1, min(num_proc, math.ceil(len(dataset) / CHUNK_ROWS)))
    tally = Tally(strict=True)
    bar = _progress_bar(len(dataset), desc) if progress else None
    try:
        with StreamWriter(directory / ARROW_FILE, schema) as writer:
            for result in convert_chunks(converter, chunks, num_proc=workers, tally=tally, progress=bar):
                writer.write(result.batch)
    finally:
        if bar is not None:
            bar.close()
    written = writer.close()
    unchanged = tokenized and tally.num_truncated == 0
    if unchanged:
        (directory / ARROW_FILE).unlink()
    logger.info("%s: converted %s on %d worker(s)", desc, tally.rate(), workers)
    return {
        "arrow": None if unchanged else ARROW_FILE,
        "rows": tally.num_accepted,
        "num_truncated": tally.num_truncated,
        "size": 0 if unchanged else written.size,
        "sha256": None if unchanged else written.sha256,
        "digest": None if unchanged else written.digest,
        "renderings": {name: tally.renderings[name] for name in sorted(tally.renderings)},
    }


def _progress_bar(total: int, desc: str) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="row", file=sys.stderr)


def _log(desc: str, entry: CacheEntry, here: bool) -> None:
    creator = entry.meta["created_by"]
    where = entry.arrow_path or "(the dataset itself: nothing to cut)"
    if here:
        logger.info("%s: tokenised pairs written to %s", desc, where)
    else:
        logger.info("%s: using %s, written by pid %s on %s", desc, where, creator["pid"], creator["host"])
