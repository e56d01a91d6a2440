"""Padded collator: the reference path (tests, and attention backends without varlen support).

``n`` pairs become ``2n`` right-padded rows in the packed order (row ``2*i`` is pair ``i``'s chosen sequence,
row ``2*i + 1`` its rejected one: :func:`~pair_dpo_trainer.collators.batch.split_pairs`). Labels follow the same
shifted convention as the packed collator: ``labels[r, j]`` is the target of the logits at ``[r, j]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from pair_dpo_trainer.collators.batch import IGNORE_INDEX, _TensorDataclass
from pair_dpo_trainer.collators.packed import pair_sequences, sequence_labels


@dataclass(frozen=True)
class PaddedPairBatch(_TensorDataclass):
    """One micro-batch of ``n`` pairs as ``2n`` right-padded rows of length ``L``.

    Attributes:
        input_ids: ``[2n, L]`` int64, right-padded with ``pad_token_id``.
        attention_mask: ``[2n, L]`` int64, 1 for real tokens and 0 for padding.
        labels: ``[2n, L]`` int64 shifted targets (next completion token of the row, else -100).
        completion_mask: ``[2n, L]`` bool, ``labels != -100``.
        num_pairs: ``n``.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    completion_mask: torch.Tensor
    num_pairs: int

    @property
    def num_sequences(self) -> int:
        """Number of rows, ``2 * num_pairs``."""
        return 2 * self.num_pairs


class PaddedPairCollator:
    """Collate a micro-batch of pairs into a :class:`PaddedPairBatch`.

    Example:
        One pair, prompt ``[5, 6]``, chosen ``[7, 2]``, rejected ``[8, 9, 2]``, ``pad_token_id=0``::

            batch = PaddedPairCollator()([
                {"prompt_input_ids": [5, 6], "chosen_input_ids": [7, 2], "rejected_input_ids": [8, 9, 2]}
            ])
            batch.input_ids       == [[5, 6, 7, 2, 0], [5, 6, 8, 9, 2]]
            batch.attention_mask  == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
            batch.labels          == [[-100, 7, 2, -100, -100], [-100, 8, 9, 2, -100]]
            batch.completion_mask == [[F, T, T, F, F], [F, T, T, T, F]]

    Args:
        pad_token_id: Token id used for right padding.
        pad_to_multiple_of: If set, round ``L`` up to a multiple of it.

    Raises:
        PreferenceRowError: ``empty_completion``, as for the packed collator.
    """

    def __init__(self, pad_token_id: int = 0, pad_to_multiple_of: int | None = None) -> None:
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be a positive int or None, got {pad_to_multiple_of}")
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features: Sequence[Mapping[str, Sequence[int]]]) -> PaddedPairBatch:
        """Pad ``features`` (``n`` pairs) into ``2n`` rows; see the class docstring."""
        if len(features) == 0:
            raise ValueError("PaddedPairCollator got an empty micro-batch")
        rows: list[tuple[list[int], list[int]]] = []
        for index, feature in enumerate(features):
            chosen, rejected, prompt_length = pair_sequences(feature, index)
            rows.extend((seq, sequence_labels(seq, prompt_length)) for seq in (chosen, rejected))
        width = max(len(seq) for seq, _ in rows)
        if self.pad_to_multiple_of is not None:
            width += -width % self.pad_to_multiple_of
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.int64)
        attention = torch.zeros((len(rows), width), dtype=torch.int64)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.int64)
        for r, (seq, seq_labels) in enumerate(rows):
            ids[r, : len(seq)] = torch.tensor(seq, dtype=torch.int64)
            attention[r, : len(seq)] = 1
            labels[r, : len(seq)] = torch.tensor(seq_labels, dtype=torch.int64)
        n = len(features)
        return PaddedPairBatch(
            input_ids=ids,
            attention_mask=attention,
            labels=labels,
            completion_mask=labels != IGNORE_INDEX,
            num_pairs=n,
        )
