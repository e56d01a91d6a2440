"""Turning whatever the user passes as a dataset into tokenised pairs for the trainer."""

from __future__ import annotations

from typing import Any

from pair_dpo_trainer.data.tokenize import FEATURE_COLUMNS, tokenize_dataset


def is_tokenized(dataset: Any) -> bool:
    """True when ``dataset`` already has the ``*_input_ids`` columns (a ``datasets.Dataset`` or list of dicts)."""
    columns = getattr(dataset, "column_names", None)
    if columns is None:
        columns = list(dataset[0].keys()) if len(dataset) > 0 else []
    return all(column in columns for column in FEATURE_COLUMNS)


def as_pair_dataset(
    dataset: Any, tokenizer: Any, *, max_length: int, max_prompt_length: int, max_tokens_per_microbatch: int | None
) -> Any:
    """Returns tokenised pairs: ``dataset`` itself when already tokenised, else its rows normalised and tokenised.

    Raw rows are tokenised strictly: the first malformed row raises its ``PreferenceRowError`` (the trainer fails
    closed; use ``pair-dpo prepare-data`` to drop and count bad rows instead).

    Args:
        dataset: Preference rows in any supported shape, or tokenised pairs.
        tokenizer: Tokenizer with a chat template.
        max_length / max_prompt_length / max_tokens_per_microbatch: See
            :func:`pair_dpo_trainer.data.tokenize.tokenize_pair`.

    Returns:
        A sequence of feature dicts (or the given tokenised dataset).
    """
    if is_tokenized(dataset):
        return dataset
    result = tokenize_dataset(
        dataset,
        tokenizer,
        max_length=max_length,
        max_prompt_length=max_prompt_length,
        max_tokens_per_microbatch=max_tokens_per_microbatch,
        strict=True,
        desc="train/eval dataset",
    )
    return result.features
