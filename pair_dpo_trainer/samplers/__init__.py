"""Pair schedule: balanced, pair-atomic epoch plans (:mod:`.planner`) and the per-rank batch sampler.

``plan_epoch(costs, *, world_size, pairs_per_rank, microbatches | max_tokens_per_microbatch, seed, epoch)`` returns
``plan[step][rank][microbatch] -> pair indices``; ``PairBatchSampler`` yields one rank's micro-batches (fixed count),
``PairStepSampler`` one rank's steps (fixed count or token budget).
"""

from __future__ import annotations

from pair_dpo_trainer.samplers.planner import (
    EpochPlan,
    balanced_partition,
    microbatch_sizes,
    plan_epoch,
    plan_epoch_array,
)
from pair_dpo_trainer.samplers.sampler import PairBatchSampler, PairStepSampler

__all__ = [
    "EpochPlan",
    "PairBatchSampler",
    "PairStepSampler",
    "balanced_partition",
    "microbatch_sizes",
    "plan_epoch",
    "plan_epoch_array",
]
