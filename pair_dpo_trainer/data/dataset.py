"""Turning whatever the user passes as a dataset into tokenised pairs for the trainer, within the run's limits.

Every input path gets the same length limits and the same truncation rule
(:func:`~pair_dpo_trainer.data.tokenize.truncate_pair`): raw rows are tokenised and truncated, pre-tokenised rows are
truncated, and a ``prepare-data`` split (:class:`~pair_dpo_trainer.data.prepared.PreparedSplit`) is first checked
against the run's tokenizer and limits, then truncated. The number of truncated pairs is logged once per dataset.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from pair_dpo_trainer.data.prepared import PreparedSplit
from pair_dpo_trainer.data.tokenize import FEATURE_COLUMNS, TokenizationResult, tokenize_dataset, truncate_dataset

logger = logging.getLogger(__name__)


def is_tokenized(dataset: Any) -> bool:
    """True when ``dataset`` already has the ``*_input_ids`` columns (a ``datasets.Dataset`` or list of dicts)."""
    columns = getattr(dataset, "column_names", None)
    if columns is None:
        columns = list(dataset[0].keys()) if len(dataset) > 0 else []
    return all(column in columns for column in FEATURE_COLUMNS)


def as_pair_dataset(
    dataset: Any,
    tokenizer: Any,
    *,
    max_length: int,
    max_prompt_length: int,
    max_tokens_per_microbatch: int | None,
    progress: bool = False,
    desc: str = "dataset",
) -> Any:
    """Returns the tokenised pairs of ``dataset`` within ``max_length`` / ``max_prompt_length``.

    Rows are converted strictly: the first malformed (or, once truncated, invalid) row raises its
    ``PreferenceRowError`` naming the row by its 0-based index (the trainer fails closed; use ``pair-dpo
    prepare-data`` to drop and count bad rows instead).

    Args:
        dataset: Preference rows in any supported shape, tokenised pairs, a :class:`PreparedSplit`, or a dict of
            named eval datasets (each converted; returned as a dict).
        tokenizer: The run's tokenizer.
        max_length / max_prompt_length / max_tokens_per_microbatch: See
            :func:`pair_dpo_trainer.data.tokenize.tokenize_pair`.
        progress: Show a progress bar on stderr while tokenising raw rows.
        desc: Name of the dataset in messages, the log line and the progress bar.

    Returns:
        A sequence of feature dicts; pre-tokenised input that needed no truncation is returned as it is.

    Raises:
        ConfigError: ``tokenizer_mismatch`` / ``limits_looser_than_prepared`` for a prepared split that does not fit
            the run (see :mod:`pair_dpo_trainer.data.prepared`).
        PreferenceRowError: The first bad row.
    """
    limits: dict[str, Any] = {
        "max_length": max_length,
        "max_prompt_length": max_prompt_length,
        "max_tokens_per_microbatch": max_tokens_per_microbatch,
    }
    if isinstance(dataset, Mapping):  # several eval sets by name, as Trainer accepts them
        return {
            name: as_pair_dataset(part, tokenizer, **limits, progress=progress, desc=f"{desc} {name!r}")
            for name, part in dataset.items()
        }
    if isinstance(dataset, PreparedSplit):
        dataset.check(tokenizer, max_length=max_length, max_prompt_length=max_prompt_length)
        dataset = dataset.rows
    if is_tokenized(dataset):
        result = truncate_dataset(dataset, **limits, strict=True, desc=desc)
        features = dataset if result.num_truncated == 0 else result.features
    else:
        result = tokenize_dataset(dataset, tokenizer, **limits, strict=True, progress=progress, desc=desc)
        features = result.features
    _log_truncation(result, desc, max_length, max_prompt_length)
    return features


def _log_truncation(result: TokenizationResult, desc: str, max_length: int, max_prompt_length: int) -> None:
    if result.num_truncated:
        logger.warning(
            "%s: truncated %d of %d pairs to max_length=%d / max_prompt_length=%d (prompts keep their end, "
            "completions their start; a cut completion has no EOS).",
            desc,
            result.num_truncated,
            result.num_accepted,
            max_length,
            max_prompt_length,
        )
    else:
        logger.info("%s: %d pairs, none truncated.", desc, result.num_accepted)
