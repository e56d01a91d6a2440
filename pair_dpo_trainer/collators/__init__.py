"""Collators: a micro-batch of preference pairs -> one packed row, or 2n padded rows (reference path)."""

from pair_dpo_trainer.collators.batch import CHOSEN, IGNORE_INDEX, REJECTED, PackedPairBatch, pair_rows, split_pairs
from pair_dpo_trainer.collators.packed import PackedPairCollator
from pair_dpo_trainer.collators.padded import PaddedPairBatch, PaddedPairCollator

__all__ = [
    "CHOSEN",
    "IGNORE_INDEX",
    "REJECTED",
    "PackedPairBatch",
    "PackedPairCollator",
    "PaddedPairBatch",
    "PaddedPairCollator",
    "pair_rows",
    "split_pairs",
]
