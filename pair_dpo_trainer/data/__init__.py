"""Preference data: normalise rows of any supported shape, tokenise them (chat template, or concatenation without
one), truncate every input path by one rule, split them, and check prepared directories against the run.

See ``normalize.py`` (row shapes and validation), ``tokenize.py`` (tokenisation and truncation), ``prepare.py``
(the ``pair-dpo prepare-data`` command), ``prepared.py`` (a prepared directory as the trainer gets it) and
``fingerprint.py`` (the tokenizer fingerprint its manifest records).
"""

from __future__ import annotations

from pair_dpo_trainer.data.costs import pair_costs
from pair_dpo_trainer.data.fingerprint import tokenizer_fingerprint
from pair_dpo_trainer.data.normalize import ROLES, PreferencePair, normalize_row, prompt_hash
from pair_dpo_trainer.data.prepared import PreparedSplit, load_prepared
from pair_dpo_trainer.data.tokenize import (
    FEATURE_COLUMNS,
    TokenizationResult,
    TokenizedPair,
    tokenize_dataset,
    tokenize_pair,
    truncate_dataset,
    truncate_pair,
)

__all__ = [
    "FEATURE_COLUMNS",
    "ROLES",
    "PreferencePair",
    "PreparedSplit",
    "TokenizationResult",
    "TokenizedPair",
    "load_prepared",
    "normalize_row",
    "pair_costs",
    "prompt_hash",
    "tokenize_dataset",
    "tokenize_pair",
    "tokenizer_fingerprint",
    "truncate_dataset",
    "truncate_pair",
]
