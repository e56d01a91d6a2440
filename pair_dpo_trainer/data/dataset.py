"""Turning whatever the user passes as a dataset into tokenised pairs for the trainer, within the run's limits.

Every input path gets the same length limits and the same truncation rule
(:func:`~pair_dpo_trainer.data.tokenize.truncate_pair`): raw rows are tokenised and truncated, pre-tokenised rows are
truncated, and a ``prepare-data`` split (:class:`~pair_dpo_trainer.data.prepared.PreparedSplit`) is first checked
against the run's tokenizer and limits, then truncated. The number of truncated pairs is logged once per dataset.

What the trainer then holds is Arrow, memory-mapped: raw rows and pre-tokenised ``datasets.Dataset`` rows
are converted once per node, on ``dataset_num_proc`` workers, into the tokenised-pairs cache
(:mod:`pair_dpo_trainer.data.pairs`); a split prepared with the run's own limits is its ``<split>.arrow``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pair_dpo_trainer.data.arrow import content_fingerprint, is_arrow_dataset
from pair_dpo_trainer.data.cache import META_FILE, PairCache, key_digest, rows_fingerprint
from pair_dpo_trainer.data.costs import pair_cost_array
from pair_dpo_trainer.data.pairs import OncePerNode, build_pairs, in_this_process
from pair_dpo_trainer.data.prepared import PreparedSplit
from pair_dpo_trainer.data.token_ids import check_token_ids, check_whole_ids
from pair_dpo_trainer.data.tokenize import FEATURE_COLUMNS, truncate_dataset, truncate_pair
from pair_dpo_trainer.errors import PreferenceRowError

logger = logging.getLogger(__name__)


def is_tokenized(dataset: Any) -> bool:
    """True when ``dataset`` already has the ``*_input_ids`` columns (a ``datasets.Dataset`` or list of dicts)."""
    columns = getattr(dataset, "column_names", None)
    if columns is None:
        columns = list(dataset[0].keys()) if len(dataset) > 0 else []
    return all(column in columns for column in FEATURE_COLUMNS)


RENDERING_WORDS = {
    "strings_raw": "raw text ({n} plain-string rows, no chat template)",
    "strings_templated": "chat template ({n} plain-string rows, apply_chat_template_to_strings)",
    "conversations": "chat template ({n} conversations)",
}
"""How :func:`rendering_summary` names each rendering (``data.tokenize.RENDERINGS``)."""


def rendering_summary(renderings: Mapping[str, int]) -> str:
    """How a dataset's rows became tokens, in words (the run summary's ``train: ...``).

    Example:
        >>> rendering_summary({"strings_raw": 16, "conversations": 2})
        'raw text (16 plain-string rows, no chat template) + chat template (2 conversations)'
        >>> rendering_summary({})
        'pre-tokenised ids'
    """
    parts = [RENDERING_WORDS[name].format(n=renderings[name]) for name in RENDERING_WORDS if renderings.get(name)]
    return " + ".join(parts) if parts else "pre-tokenised ids"


def as_pair_dataset(dataset: Any, tokenizer: Any, **options: Any) -> Any:
    """The tokenised pairs of ``dataset`` (:func:`pair_dataset_and_rendering` without the renderings)."""
    return pair_dataset_and_rendering(dataset, tokenizer, **options)[0]


def pair_dataset_and_rendering(
    dataset: Any,
    tokenizer: Any,
    *,
    max_length: int,
    max_prompt_length: int,
    max_tokens_per_microbatch: int | None,
    share_prompt: bool = False,
    progress: bool = False,
    desc: str = "dataset",
    num_proc: int = 1,
    cache_dir: str | None = None,
    once: OncePerNode = in_this_process,
    apply_chat_template_to_strings: bool = False,
    vocab_size: int | None = None,
) -> tuple[Any, dict[str, str]]:
    """Returns the tokenised pairs of ``dataset`` within ``max_length`` / ``max_prompt_length``, and how each
    dataset's rows were rendered (``desc`` -> :func:`rendering_summary`; one entry per named eval set).

    Strict: the first malformed (or, once truncated, invalid) row raises its ``PreferenceRowError`` naming it by its
    0-based index (``pair-dpo prepare-data`` drops and counts bad rows instead). Raw rows and pre-tokenised
    ``datasets.Dataset`` rows are converted once per node by ``num_proc`` workers into the cache and memory-mapped
    (:mod:`pair_dpo_trainer.data.pairs`); a split prepared with the run's limits is memory-mapped as it is; a Python
    list of pre-tokenised rows is truncated in this process.

    Args:
        dataset: Preference rows in any supported shape, tokenised pairs, a :class:`PreparedSplit`, or a dict of
            named eval datasets (each converted; returned as a dict).
        tokenizer: The run's tokenizer.
        max_length / max_prompt_length / max_tokens_per_microbatch: See
            :func:`pair_dpo_trainer.data.tokenize.tokenize_pair`.
        share_prompt: The run packs the shared-prompt layout, so the budget admits a pair by ``prompt + chosen +
            rejected`` (else ``2 x prompt + chosen + rejected``): what the samplers balance and the row holds.
        progress: Show a progress bar (rows/s) on stderr while converting.
        desc: Name of the dataset in messages, the log line and the progress bar.
        num_proc: Worker processes that convert rows (on the node's local main process).
        cache_dir: Root of the tokenised-pairs cache (None: :func:`~pair_dpo_trainer.data.cache.default_cache_dir`).
        once: Runs a conversion once per node (``parallel.node.Node.once``); default: in this process.
        apply_chat_template_to_strings: Render plain-string rows with the chat template instead of as raw text.
        vocab_size: Rows of the model's input embedding: every token id of the pairs is checked to lie in
            ``[0, vocab_size)`` (:func:`~pair_dpo_trainer.data.token_ids.check_token_ids`); None: not checked.

    Returns:
        A memory-mapped ``datasets.Dataset`` (a list of feature dicts for a list of pre-tokenised rows; a dict of
        them for a dict of eval sets); pre-tokenised input that needed no truncation is returned as it is. With it,
        ``{desc: rendering}``.

    Raises:
        ConfigError: ``tokenizer_mismatch`` / ``limits_looser_than_prepared`` / ``rendering_mismatch`` for a
            prepared split that does not fit the run (see :mod:`pair_dpo_trainer.data.prepared`), ``bad_manifest``
            for one whose bytes do not match its manifest; ``bad_token_id`` (an id outside the embedding, or a
            pre-tokenised id that is not a whole number); ``dataset_cache_unwritable``.
        PreferenceRowError: The first bad row.
    """
    limits: dict[str, Any] = dict(max_length=max_length, max_prompt_length=max_prompt_length)
    limits["max_tokens_per_microbatch"] = max_tokens_per_microbatch
    if max_tokens_per_microbatch is not None:  # the layout admits pairs only under a budget (and keys the cache)
        limits["share_prompt"] = share_prompt
    options: dict[str, Any] = dict(progress=progress, num_proc=num_proc, cache_dir=cache_dir, once=once)
    options.update(apply_chat_template_to_strings=apply_chat_template_to_strings, vocab_size=vocab_size)
    if isinstance(dataset, Mapping):  # several eval sets by name, as Trainer accepts them
        converted = {
            name: _one_dataset(part, tokenizer, limits, f"{desc} {name!r}", **options) for name, part in dataset.items()
        }
        renderings = {f"{desc} {name!r}": rendering for name, (_, rendering) in converted.items()}
        return {name: pairs for name, (pairs, _) in converted.items()}, renderings
    pairs, rendering = _one_dataset(dataset, tokenizer, limits, desc, **options)
    return pairs, {desc: rendering}


def _one_dataset(
    dataset: Any,
    tokenizer: Any,
    limits: Mapping[str, Any],
    desc: str,
    *,
    progress: bool,
    num_proc: int,
    cache_dir: str | None,
    once: OncePerNode,
    apply_chat_template_to_strings: bool,
    vocab_size: int | None,
) -> tuple[Any, str]:
    """:func:`pair_dataset_and_rendering` of one dataset: its pairs (their ids checked against ``vocab_size``) and
    its rendering in words."""
    options: dict[str, Any] = dict(progress=progress, num_proc=num_proc, cache_dir=cache_dir, once=once)
    if not isinstance(dataset, PreparedSplit) and is_tokenized(dataset):
        check_whole_ids(dataset, desc)  # before the truncation: 1.5 would be cut to 1, NaN fail as a raw Arrow error
    pairs, rendering = _convert(dataset, tokenizer, limits, desc, apply_chat_template_to_strings, **options)
    if vocab_size is not None:
        check_token_ids(pairs, vocab_size, desc)
    return pairs, rendering


def _convert(
    dataset: Any,
    tokenizer: Any,
    limits: Mapping[str, Any],
    desc: str,
    apply_chat_template_to_strings: bool,
    *,
    progress: bool,
    num_proc: int,
    cache_dir: str | None,
    once: OncePerNode,
) -> tuple[Any, str]:
    """The pairs of one dataset and its rendering in words; a prepared split's bytes are verified first, once per
    node (:meth:`~pair_dpo_trainer.data.prepared.PreparedSplit.verify`)."""
    rendering = None
    if isinstance(dataset, PreparedSplit):
        rendering = f"prepared in {dataset.directory} ({rendering_summary(dataset.renderings)})"
        proof, here = once(dataset.verify)  # hashed by the node's local main
        if not here:
            dataset.verify(proof)  # the node's other ranks: not hashed again while the file is the one proven
        dataset.check(
            tokenizer,
            max_length=limits["max_length"],
            max_prompt_length=limits["max_prompt_length"],
            apply_chat_template_to_strings=apply_chat_template_to_strings,
        )
        if dataset.prepared_with(max_length=limits["max_length"], max_prompt_length=limits["max_prompt_length"]):
            check_budget(dataset.rows, limits, desc)  # the rows are within these limits already: nothing to cut
            _log_truncation(desc, 0, len(dataset.rows), limits)
            return dataset.rows, rendering
        dataset = dataset.rows
    if is_tokenized(dataset) and not is_arrow_dataset(dataset):
        names = getattr(dataset, "row_names", None)  # rows read from a file (data.rownames.FileRows)
        result = truncate_dataset(dataset, **limits, strict=True, desc=desc, row_names=names)
        _log_truncation(desc, result.num_truncated, result.num_accepted, limits)
        return (dataset if result.num_truncated == 0 else result.features), rendering or rendering_summary({})
    built = build_pairs(
        dataset,
        tokenizer,
        limits,
        tokenized=is_tokenized(dataset),
        desc=desc,
        num_proc=num_proc,
        cache=PairCache(cache_dir),
        once=once,
        progress=progress,
        apply_chat_template_to_strings=apply_chat_template_to_strings,
    )
    _log_truncation(desc, built.num_truncated, built.num_rows, limits)
    return built.dataset, rendering or rendering_summary(built.renderings)


def pairs_digest(pairs: Any) -> str:
    """A digest of the tokenised pairs a run trains on, equal exactly when the pairs are: what the ranks compare
    before the first step (``ranks_disagree``), since equal pair costs alone let each rank train on its own rows.

    Read, not computed, where one is recorded: pairs memory-mapped from a tokenised-pairs cache entry give the digest
    of the entry's key (the rows' fingerprint, the tokenizer's, the limits), a ``prepare-data`` split the digest its
    ``manifest.json`` records. Other pairs (a pre-tokenised dataset used as it is, a Python list) are hashed here.

    Args:
        pairs: What :func:`pair_dataset_and_rendering` returned for one dataset.
    """
    recorded = _recorded_digest(pairs)
    if recorded is not None:
        return recorded
    return f"rows {content_fingerprint(pairs) if is_arrow_dataset(pairs) else rows_fingerprint(pairs)}"


def _recorded_digest(pairs: Any) -> str | None:
    """The cache entry's key digest or the prepared split's manifest digest of memory-mapped ``pairs``, else None."""
    files = getattr(pairs, "cache_files", None) or []
    if len(files) != 1 or getattr(pairs, "_indices", None) is not None:
        return None  # several files, or a selection of rows: not what a recorded digest covers
    arrow = Path(files[0]["filename"])
    meta = _read_json(arrow.parent / META_FILE)
    if isinstance(meta.get("key"), dict) and (meta.get("result") or {}).get("arrow") == arrow.name:
        return f"cache entry {key_digest(meta['key'])}"
    output = (_read_json(arrow.parent / "manifest.json").get("outputs") or {}).get(arrow.name) or {}
    digest = (output.get("digest") or {}).get("digest") if isinstance(output, dict) else None
    return f"prepared split {digest}" if isinstance(digest, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def prepared_limits(datasets: Any) -> tuple[int, int] | None:
    """``(max_length, max_prompt_length)`` of the first ``prepare-data`` split among ``datasets`` (None if none)."""
    for dataset in datasets:
        parts = dataset.values() if isinstance(dataset, Mapping) else [dataset]
        for part in parts:
            if isinstance(part, PreparedSplit):
                return part.limits
    return None


def check_budget(rows: Any, limits: Mapping[str, Any], desc: str) -> None:
    """Raises the ``pair_too_long`` error of the first pair of ``rows`` that costs more than the micro-batch budget
    in the run's packed layout (``limits["share_prompt"]``).

    The costs come from the Arrow lengths (:func:`~pair_dpo_trainer.data.costs.pair_cost_array`); the error is the
    one :func:`~pair_dpo_trainer.data.tokenize.truncate_pair` raises for that row, named by its index.
    """
    budget = limits.get("max_tokens_per_microbatch")
    if budget is None:
        return
    over = np.flatnonzero(pair_cost_array(rows, share_prompt=limits.get("share_prompt", False)) > budget)
    if over.size == 0:
        return
    index = int(over[0])
    row = rows[index]
    try:
        truncate_pair(*(row[column] for column in FEATURE_COLUMNS), **limits)
    except PreferenceRowError as exc:
        raise PreferenceRowError(exc.reason_code, f"{desc} row {index}: {exc.message}") from exc
    raise AssertionError(f"{desc} row {index} costs more than {budget} tokens but truncate_pair accepted it")


def _log_truncation(desc: str, num_truncated: int, num_pairs: int, limits: Mapping[str, Any]) -> None:
    if num_truncated:
        logger.warning(
            "%s: truncated %d of %d pairs to max_length=%d / max_prompt_length=%d (prompts keep their end, "
            "completions their start; a cut completion has no EOS).",
            desc,
            num_truncated,
            num_pairs,
            limits["max_length"],
            limits["max_prompt_length"],
        )
    else:
        logger.info("%s: %d pairs, none truncated.", desc, num_pairs)
