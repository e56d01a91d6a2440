"""Evaluation schedule: every pair exactly once, yet the same number of non-empty micro-batches on every rank.

Training drops the remainder smaller than one step; evaluation must not. The last step can leave a rank short of
pairs, and under ZeRO-3 every rank must still run the same number of forwards, so such a rank gets a duplicate pair
of weight 0: it runs the forward, and its metrics do not count.

Details: samplers/README.md, "Module notes", ``evaluation.py``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from pair_dpo_trainer.errors import ScheduleError
from pair_dpo_trainer.samplers.planner import check_budget

WeightedIndex = tuple[int, float]


def plan_eval(
    costs: Sequence[int] | np.ndarray,
    *,
    world_size: int,
    rank: int,
    pairs_per_microbatch: int,
    max_tokens_per_microbatch: int | None = None,
) -> list[list[WeightedIndex]]:
    """Micro-batches of ``(pair index, weight)`` for one rank; all ranks get the same count.

    Pairs are taken longest first so that the pairs of one step have similar lengths (balanced ranks); a step of
    ``world_size * pairs_per_microbatch`` pairs is dealt to ranks in a strided way. With a budget, see the module
    docstring.

    Args:
        costs: Token cost per pair.
        world_size: Number of data-parallel ranks.
        rank: This rank.
        pairs_per_microbatch: At most this many pairs per micro-batch.
        max_tokens_per_microbatch: If set, at most this many tokens (summed cost) per micro-batch.

    Raises:
        ScheduleError: ``too_few_pairs`` for an empty eval set, ``bad_layout`` for non-positive sizes,
            ``pair_too_long`` for a pair costing more than the budget.
    """
    if world_size < 1 or pairs_per_microbatch < 1 or not 0 <= rank < world_size:
        raise ScheduleError(
            "bad_layout",
            f"eval layout world_size={world_size}, rank={rank}, per_device_eval_batch_size={pairs_per_microbatch}: "
            "sizes must be positive and the rank inside the world.",
        )
    if len(costs) == 0:
        raise ScheduleError("too_few_pairs", "the eval dataset is empty: pass eval pairs or disable evaluation.")
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    if max_tokens_per_microbatch is not None:
        check_budget(np.asarray(costs), max_tokens_per_microbatch)
        return _plan_eval_budget(costs, order, world_size, rank, pairs_per_microbatch, max_tokens_per_microbatch)
    step = world_size * pairs_per_microbatch
    batches: list[list[WeightedIndex]] = []
    for start in range(0, len(order), step):
        mine = order[start : start + step][rank::world_size]
        batches.append([(i, 1.0) for i in mine] if mine else [(order[0], 0.0)])
    return batches


def _plan_eval_budget(
    costs: Sequence[int] | np.ndarray, order: list[int], world_size: int, rank: int, cap: int, budget: int
) -> list[list[WeightedIndex]]:
    """Next-fit packing of each rank's strided share of ``order``; short ranks padded with weight-0 fillers."""
    counts = []
    for r in range(world_size):
        batches = _next_fit(order[r::world_size], costs, cap, budget)
        counts.append(len(batches))
        if r == rank:
            mine = batches
    filler = [(order[-1], 0.0)]
    return [[(i, 1.0) for i in batch] for batch in mine] + [filler] * (max(counts) - len(mine))


def _next_fit(indices: list[int], costs: Sequence[int] | np.ndarray, cap: int, budget: int) -> list[list[int]]:
    """Consecutive ``indices`` in micro-batches of at most ``cap`` pairs and ``budget`` tokens."""
    batches: list[list[int]] = []
    load = 0
    for i in indices:
        if not batches or len(batches[-1]) == cap or load + costs[i] > budget:
            batches.append([])
            load = 0
        batches[-1].append(i)
        load += costs[i]
    return batches


class EvalBatchSampler:
    """Batch sampler over :func:`plan_eval` micro-batches (keys are ``(index, weight)`` tuples).

    Use with :class:`WeightedPairs`, which turns a key into the feature dict plus ``pair_weight``.
    """

    def __init__(
        self,
        costs: Sequence[int] | np.ndarray,
        *,
        world_size: int,
        rank: int,
        pairs_per_microbatch: int,
        max_tokens_per_microbatch: int | None = None,
    ) -> None:
        self._batches = plan_eval(
            costs,
            world_size=world_size,
            rank=rank,
            pairs_per_microbatch=pairs_per_microbatch,
            max_tokens_per_microbatch=max_tokens_per_microbatch,
        )

    def __iter__(self) -> Iterator[list[WeightedIndex]]:
        return iter(self._batches)

    def __len__(self) -> int:
        return len(self._batches)


class WeightedPairs:
    """Dataset view: ``view[(i, w)]`` is ``dataset[i]`` with an added ``pair_weight`` of ``w``."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __getitem__(self, key: WeightedIndex) -> dict:
        index, weight = key
        return {**self.dataset[int(index)], "pair_weight": float(weight)}

    def __len__(self) -> int:
        return len(self.dataset)
