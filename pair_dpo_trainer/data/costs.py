"""A tokenised pair's cost: the tokens it packs into a micro-batch (``2 * len(prompt) + len(chosen) +
len(rejected)``, or the prompt once in the shared-prompt layout), what the samplers balance and the token budget
bounds."""

from __future__ import annotations

from typing import Any

import numpy as np

from pair_dpo_trainer.data.arrow import arrow_lengths, is_arrow_dataset
from pair_dpo_trainer.data.tokenize import FEATURE_COLUMNS


def pair_costs(rows: Any) -> list[int]:
    """Returns each pair's cost ``2 * len(prompt) + len(chosen) + len(rejected)`` of a tokenised dataset.

    Args:
        rows: A ``datasets.Dataset`` or a sequence of mappings with the ``*_input_ids`` columns.

    Example:
        >>> row = {"prompt_input_ids": [1, 2], "chosen_input_ids": [3], "rejected_input_ids": [4, 5, 6]}
        >>> pair_costs([row])
        [8]
    """
    return pair_cost_array(rows).tolist()


def pair_cost_array(rows: Any, *, share_prompt: bool = False) -> np.ndarray:
    """:func:`pair_costs` as an ``[N]`` int64 array; for a ``datasets.Dataset`` computed from the Arrow list lengths
    of its token columns, batch by batch (no Python object per pair, no token read). With ``share_prompt`` the
    cost in the shared-prompt layout, ``len(prompt) + len(chosen) + len(rejected)`` (the prompt packed once).

    Raises:
        KeyError: A ``datasets.Dataset`` without the three ``*_input_ids`` columns.
    """
    if is_arrow_dataset(rows):
        missing = [c for c in FEATURE_COLUMNS if c not in rows.column_names]
        if missing:
            raise KeyError(f"the dataset lacks the column(s) {missing}; tokenise it first (tokenize_dataset).")
        prompt, chosen, rejected = (arrow_lengths(rows, column) for column in FEATURE_COLUMNS)
        return (1 if share_prompt else 2) * prompt + chosen + rejected
    copies = 1 if share_prompt else 2
    costs = (
        copies * len(row["prompt_input_ids"]) + len(row["chosen_input_ids"]) + len(row["rejected_input_ids"])
        for row in rows
    )
    return np.fromiter(costs, dtype=np.int64)
