"""One optimizer step of one rank as ONE DataLoader item: its packed micro-batches, however many there are.

With a token budget the number of micro-batches changes from step to step (it is the same on every rank), while HF
Trainer counts gradient accumulation in DataLoader items. So the train DataLoader yields whole steps
(:class:`~pair_dpo_trainer.samplers.sampler.PairStepSampler`), the Trainer runs with ``gradient_accumulation_steps=1``
and :mod:`pair_dpo_trainer.training.accumulation` runs the micro-batches of the item. ``len(dataloader)`` is then the
number of
optimizer steps, so the Trainer's ``steps_in_epoch``, ``num_update_steps_per_epoch``, LR schedule, ``global_step`` and
its resume skip (``global_step % steps_per_epoch`` items) all count optimizer steps.

Details: collators/README.md, "Module notes", ``step.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pair_dpo_trainer.collators.batch import PackedPairBatch
from pair_dpo_trainer.collators.packed import PackedPairCollator


@dataclass(frozen=True)
class StepBatch:
    """One rank's micro-batches of one optimizer step, in the order they run.

    Attributes:
        microbatches: The packed micro-batches (each one row, see :class:`PackedPairBatch`), at least one.
    """

    microbatches: tuple[PackedPairBatch, ...]

    def __len__(self) -> int:
        return len(self.microbatches)

    @property
    def num_pairs(self) -> int:
        """Pairs of this rank in the step."""
        return sum(mb.num_pairs for mb in self.microbatches)

    @property
    def num_tokens(self) -> int:
        """Packed tokens of all micro-batches (pad segments included), host-known."""
        return sum(mb.num_tokens for mb in self.microbatches)

    @property
    def num_real_tokens(self) -> int:
        """Tokens of the pairs' sequences of all micro-batches (pad segments excluded), host-known."""
        return sum(mb.num_real_tokens for mb in self.microbatches)

    @property
    def num_row_tokens(self) -> int:
        """Tokens of the pairs' sequences of all micro-batches' whole rows, whichever ranks compute them."""
        return sum(mb.num_row_tokens for mb in self.microbatches)

    @property
    def num_row_unshared_tokens(self) -> int:
        """:attr:`num_row_tokens` with every prompt counted twice (TRL's layout)."""
        return sum(mb.num_row_unshared_tokens for mb in self.microbatches)

    @property
    def num_unshared_tokens(self) -> int:
        """Tokens of the pairs' sequences with each prompt counted twice (TRL's layout), host-known."""
        return sum(mb.num_unshared_tokens for mb in self.microbatches)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> StepBatch:
        """A copy with every micro-batch on ``device``."""
        return StepBatch(tuple(mb.to(device, non_blocking=non_blocking) for mb in self.microbatches))

    def pin_memory(self) -> StepBatch:
        """A copy in pinned memory (``DataLoader(pin_memory=True)`` calls it)."""
        return StepBatch(tuple(mb.pin_memory() for mb in self.microbatches))


class StepPairs:
    """Dataset view for :class:`PairStepSampler` items: ``view[[i, j, ...]]`` is the list of feature dicts.

    The DataLoader fetches every element of a batch-sampler item with ``dataset[element]``; a step item's elements
    are micro-batches (lists of pair indices), so each fetch returns one micro-batch's features.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __getitem__(self, microbatch: Sequence[int]) -> list[Mapping[str, Any]]:
        return [self.dataset[int(index)] for index in microbatch]

    def __len__(self) -> int:
        return len(self.dataset)


class StepCollator:
    """Packs each micro-batch of a step with ``collator`` (one row each) into a :class:`StepBatch`.

    Args:
        collator: The micro-batch collator (``PackedPairCollator``, with ``pad_to_length`` under ``pad_to_budget``).
    """

    def __init__(self, collator: PackedPairCollator) -> None:
        self.collator = collator

    def __call__(self, microbatches: Sequence[Sequence[Mapping[str, Any]]]) -> StepBatch:
        if len(microbatches) == 0:
            raise ValueError("StepCollator got a step without micro-batches")
        return StepBatch(tuple(self.collator(features) for features in microbatches))
