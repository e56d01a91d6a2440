"""Pair schedule: balanced, pair-atomic epoch plans (:mod:`.planner`) and the per-rank batch sampler.

``plan_epoch(costs, *, world_size, pairs_per_rank, microbatches, seed, epoch)`` returns
``plan[step][rank][microbatch] -> pair indices``; ``PairBatchSampler`` yields one rank's micro-batches.
"""

from __future__ import annotations

from pair_dpo_trainer.samplers.planner import (
    EpochPlan,
    balanced_partition,
    microbatch_sizes,
    plan_epoch,
    plan_epoch_array,
)
from pair_dpo_trainer.samplers.sampler import PairBatchSampler

__all__ = [
    "EpochPlan",
    "PairBatchSampler",
    "balanced_partition",
    "microbatch_sizes",
    "plan_epoch",
    "plan_epoch_array",
]
