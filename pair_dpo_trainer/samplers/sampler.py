"""One rank's view of :func:`~pair_dpo_trainer.samplers.planner.plan_epoch`: ``PairBatchSampler``, ``PairStepSampler``.

Plain, re-iterable batch samplers, so they can be passed as ``DataLoader(batch_sampler=...)`` and wrapped by
accelerate's ``SkipBatchSampler`` (what HF Trainer's ``skip_first_batches`` does on resume):

* :class:`PairBatchSampler` (fixed count) yields one ``list[int]`` of pair indices per micro-batch,
  ``steps_per_epoch * microbatches`` per epoch: HF Trainer's own gradient accumulation groups them into steps.
* :class:`PairStepSampler` (fixed count or token budget) yields one item per optimizer step, the step's
  micro-batches as a ``list[list[int]]``: ``steps_per_epoch`` per epoch, however many micro-batches each step has
  (with a budget, ``M_step`` varies from step to step; it is the same on every rank).

All ranks plan the same epoch from the same arguments; ``schedule_fingerprint`` lets the trainer check that they
agree.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from pair_dpo_trainer.errors import ScheduleError
from pair_dpo_trainer.samplers.planner import EpochPlan, is_integer, plan_epoch_array

__all__ = ["PairBatchSampler", "PairStepSampler"]

_CACHED_EPOCHS = 2


class _PlannedSampler(Sampler):
    """Planning, per-epoch caching, fingerprints and the resume offset shared by both samplers.

    Args:
        costs: ``[N]`` positive integer cost of each pair (see ``plan_epoch``).
        world_size: Number of data-parallel ranks.
        rank: This process's rank in ``[0, world_size)``.
        pairs_per_rank: Pairs each rank takes per optimizer step.
        microbatches: Micro-batches per rank per step (fixed count), or None with a budget.
        max_tokens_per_microbatch: Token budget of one micro-batch, or None for a fixed count.
        seed: Non-negative shuffling seed; must be the same on all ranks.
        epoch: Initial epoch (change it with :meth:`set_epoch`).

    Raises:
        ScheduleError: the codes of ``plan_epoch`` (checked here, at construction), and ``bad_layout`` for a
            rank outside ``[0, world_size)``.
    """

    def __init__(
        self,
        costs: Sequence[int],
        *,
        world_size: int,
        rank: int,
        pairs_per_rank: int,
        microbatches: int | None = None,
        max_tokens_per_microbatch: int | None = None,
        seed: int,
        epoch: int = 0,
    ) -> None:
        super().__init__()
        self._costs = np.array(costs, copy=True)
        self._layout: dict[str, Any] = {
            "world_size": world_size,
            "pairs_per_rank": pairs_per_rank,
            "microbatches": microbatches,
            "max_tokens_per_microbatch": max_tokens_per_microbatch,
        }
        self._seed = seed
        self.epoch = epoch
        self._cache: dict[int, tuple[EpochPlan, list[list[list[int]]] | None]] = {}
        self._start_step = 0
        first = self._plan(epoch)  # validates every argument now rather than at the first iteration
        if not is_integer(rank) or not 0 <= rank < world_size:
            raise ScheduleError("bad_layout", f"rank must be an integer in [0, world_size={world_size}), got {rank!r}.")
        self.rank = rank
        self.world_size = world_size
        self.pairs_per_rank = pairs_per_rank
        self.microbatches = microbatches
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        self._steps = first.steps

    @property
    def seed(self) -> int:
        """The shuffling seed (fixed at construction: plans are cached per epoch)."""
        return self._seed

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch (``N // G``), the same on all ranks and epochs."""
        return self._steps

    @property
    def global_pairs_per_step(self) -> int:
        """``G = world_size * pairs_per_rank``: pairs per optimizer step over all ranks."""
        return self.world_size * self.pairs_per_rank

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch whose plan the next iteration follows (HF/accelerate call this each epoch)."""
        self.epoch = epoch

    def set_start_step(self, step: int) -> None:
        """Makes the next iteration start at optimizer step ``step`` of the same plan (exact resume).

        The next iteration skips the first ``step`` steps; the iteration after that one starts at step 0 again.
        Use either this or ``SkipBatchSampler``, not both.

        Raises:
            ScheduleError: ``step_out_of_range`` unless ``0 <= step <= steps_per_epoch``.
        """
        self._check_step(step, inclusive=True)
        self._start_step = int(step)

    def step_pair_count(self, step: int) -> int:
        """Global number of pairs in optimizer step ``step`` (always ``G``; the loss normaliser).

        Raises:
            ScheduleError: ``step_out_of_range`` unless ``0 <= step < steps_per_epoch``.
        """
        self._check_step(step, inclusive=False)
        return self.global_pairs_per_step

    def microbatch_counts(self, epoch: int | None = None) -> list[int]:
        """Micro-batches per rank of every step of ``epoch`` (default: the current epoch); equal on all ranks."""
        return self._plan(self.epoch if epoch is None else epoch).microbatch_counts.tolist()

    def schedule_fingerprint(self, epoch: int | None = None) -> str:
        """16-hex-digit digest of the full plan (all ranks) of ``epoch`` (default: the current epoch).

        Ranks that planned the same schedule return the same string.
        """
        return self._plan(self.epoch if epoch is None else epoch).fingerprint()

    def rank_plan(self, epoch: int | None = None) -> list[list[list[int]]]:
        """This rank's ``[step][microbatch] -> pair indices`` for ``epoch`` (default: the current epoch)."""
        return self._rank_lists(self.epoch if epoch is None else epoch)

    def _steps_to_run(self) -> list[list[list[int]]]:
        """The current epoch's steps of this rank from the start step (which is then reset to 0)."""
        start, self._start_step = self._start_step, 0
        return self._rank_lists(self.epoch)[start:]

    def _check_step(self, step: int, *, inclusive: bool) -> None:
        stop = self._steps + 1 if inclusive else self._steps
        if not is_integer(step) or not 0 <= step < stop:
            raise ScheduleError(
                "step_out_of_range",
                f"step must be an integer in [0, {stop}) for an epoch of {self._steps} optimizer steps, "
                f"got {step!r}; the checkpoint does not match this dataset/batch layout.",
            )

    def _plan(self, epoch: int) -> EpochPlan:
        return self._entry(epoch)[0]

    def _rank_lists(self, epoch: int) -> list[list[list[int]]]:
        plan, lists = self._entry(epoch)
        if lists is None:
            lists = plan.rank_microbatches(self.rank)
            self._cache[epoch] = (plan, lists)
        return lists

    def _entry(self, epoch: int) -> tuple[EpochPlan, list[list[list[int]]] | None]:
        if epoch not in self._cache:
            plan = plan_epoch_array(self._costs, seed=self._seed, epoch=epoch, **self._layout)
            while len(self._cache) >= _CACHED_EPOCHS:
                del self._cache[next(iter(self._cache))]
            self._cache[epoch] = (plan, None)
        return self._cache[epoch]


class PairBatchSampler(_PlannedSampler):
    """Batch sampler of balanced, pair-atomic micro-batches for one data-parallel rank (fixed count).

    Takes the arguments of :class:`_PlannedSampler` with ``microbatches`` (gradient accumulation steps); every step
    has exactly that many micro-batches, so HF Trainer's gradient accumulation can group them.
    """

    def __init__(self, costs: Sequence[int], **kwargs: Any) -> None:
        if kwargs.get("max_tokens_per_microbatch") is not None:
            raise ScheduleError(
                "bad_layout",
                "PairBatchSampler yields micro-batches of a fixed count; with a token budget every step has its own "
                "count: use PairStepSampler.",
            )
        super().__init__(costs, **kwargs)

    def __len__(self) -> int:
        """Micro-batches per epoch (``steps_per_epoch * microbatches``), identical on all ranks.

        Always the full epoch, even after :meth:`set_start_step` (use either it or ``SkipBatchSampler``).
        """
        return self._steps * int(self.microbatches)  # type: ignore[arg-type]  # a fixed count here (see __init__)

    def __iter__(self) -> Iterator[list[int]]:
        """Yields this rank's micro-batches of the current epoch, from the start step (then reset to 0)."""
        return (list(microbatch) for step in self._steps_to_run() for microbatch in step)


class PairStepSampler(_PlannedSampler):
    """Batch sampler of whole optimizer steps for one data-parallel rank (fixed count or token budget).

    Each item is one step's micro-batches, ``list[list[int]]`` of pair indices; pair it with
    :class:`~pair_dpo_trainer.collators.step.StepPairs` (a dataset view that takes a micro-batch of indices) and
    :class:`~pair_dpo_trainer.collators.step.StepCollator`.
    """

    def __len__(self) -> int:
        """Optimizer steps per epoch, identical on all ranks (always the full epoch, as ``PairBatchSampler``)."""
        return self._steps

    def __iter__(self) -> Iterator[list[list[int]]]:
        """Yields this rank's steps of the current epoch, from the start step (then reset to 0)."""
        return ([list(microbatch) for microbatch in step] for step in self._steps_to_run())
