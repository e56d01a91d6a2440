"""Preference data: normalise rows of any supported shape, tokenise them with a chat template, split them.

See ``normalize.py`` (row shapes and validation), ``tokenize.py`` (chat-template tokenisation and
truncation) and ``prepare.py`` (the ``pair-dpo prepare-data`` command).
"""

from __future__ import annotations

from pair_dpo_trainer.data.normalize import ROLES, PreferencePair, normalize_row, prompt_hash
from pair_dpo_trainer.data.tokenize import (
    FEATURE_COLUMNS,
    TokenizationResult,
    TokenizedPair,
    pair_costs,
    tokenize_dataset,
    tokenize_pair,
)

__all__ = [
    "FEATURE_COLUMNS",
    "ROLES",
    "PreferencePair",
    "TokenizationResult",
    "TokenizedPair",
    "normalize_row",
    "pair_costs",
    "prompt_hash",
    "tokenize_dataset",
    "tokenize_pair",
]
