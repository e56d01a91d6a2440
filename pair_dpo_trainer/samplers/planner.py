"""Balanced, pair-atomic epoch planning: the pure core of the pair schedule (Python + numpy, no torch).

Entry point: :func:`plan_epoch` ``(costs, *, world_size, pairs_per_rank, microbatches | max_tokens_per_microbatch,
seed, epoch)`` returns ``plan[step][rank][microbatch] -> list of pair indices``. :func:`plan_epoch_array` returns the
same plan as an :class:`EpochPlan` (``int64`` arrays), which is what the sampler keeps.

Algorithm (three steps: global batches from the seed, ranks balanced, micro-batches) and guarantees:
samplers/README.md, "Module notes", ``planner.py``.

Example:
    >>> costs = [10, 1, 1, 10, 5, 5, 3, 7]
    >>> plan_epoch(costs, world_size=2, pairs_per_rank=4, microbatches=2, seed=0, epoch=0)
    [[[[2, 3], [6, 7]], [[0, 1], [4, 5]]]]
    >>> plan_epoch(costs, world_size=2, pairs_per_rank=4, max_tokens_per_microbatch=12, seed=0, epoch=0)
    [[[[2, 3], [6, 7]], [[0, 1], [4, 5]]]]

    One step (G = 8, nothing dropped): rank 0 gets pairs {2, 3, 6, 7} (cost 1+10+3+7 = 21) and rank 1 gets
    {0, 1, 4, 5} (cost 10+1+5+5 = 21), each as two micro-batches, the heavier (11) before the lighter (10). With a
    budget of 12 tokens both ranks need two micro-batches; with ``epoch=1`` the same costs give a different order.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from pair_dpo_trainer.errors import ScheduleError
from pair_dpo_trainer.samplers.packing import pack_rows

__all__ = [
    "EpochPlan",
    "balanced_partition",
    "microbatch_sizes",
    "plan_epoch",
    "plan_epoch_array",
]

_FINGERPRINT_VERSION = b"pair-dpo-plan-v1"
_BUDGET_FINGERPRINT_VERSION = b"pair-dpo-budget-plan-v1"
_SPREAD_MASK = np.int64(1) << 62  # pushes a spread below every live one (costs sum far below 2**62)


@dataclass(frozen=True, eq=False)
class EpochPlan:
    """One epoch's plan in array form.

    Attributes:
        pairs: ``[steps, world_size, pairs_per_rank]`` int64 pair indices; each rank's row is its
            micro-batches concatenated in order.
        sizes: ``[steps, world_size, M_max]`` int64 pairs per micro-batch of each rank row, in order, 0 past
            the step's micro-batch count (identical for all ranks of a step in count, not in sizes).
        max_tokens_per_microbatch: The token budget of a budget plan, None for a fixed-count plan.
    """

    pairs: np.ndarray
    sizes: np.ndarray
    max_tokens_per_microbatch: int | None = None

    @property
    def steps(self) -> int:
        """Number of optimizer steps in the epoch."""
        return int(self.pairs.shape[0])

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return int(self.pairs.shape[1])

    @property
    def pairs_per_rank(self) -> int:
        """Pairs per rank per step."""
        return int(self.pairs.shape[2])

    @property
    def microbatch_counts(self) -> np.ndarray:
        """``[steps]`` micro-batches per rank in each step (the same on every rank)."""
        return (self.sizes[:, 0, :] > 0).sum(axis=1)

    @property
    def microbatch_sizes(self) -> tuple[int, ...]:
        """The sizes shared by every rank and step of a fixed-count plan.

        Raises:
            ValueError: for a budget plan, whose sizes vary (use :attr:`sizes`).
        """
        if self.max_tokens_per_microbatch is not None:
            raise ValueError("a token-budget plan has no common micro-batch sizes; read EpochPlan.sizes")
        return tuple(int(n) for n in self.sizes[0, 0])

    def rank_microbatches(self, rank: int) -> list[list[list[int]]]:
        """Returns ``[step][microbatch] -> pair indices`` for one rank."""
        rows = self.pairs[:, rank].tolist()
        with _no_gc():
            if self.max_tokens_per_microbatch is None:
                bounds = self._bounds()
                return [[row[a:b] for a, b in bounds] for row in rows]
            ends, counts = np.cumsum(self.sizes[:, rank], axis=1).tolist(), self.microbatch_counts.tolist()
            return [_cut(row, e[:m]) for row, e, m in zip(rows, ends, counts, strict=True)]

    def to_lists(self) -> list[list[list[list[int]]]]:
        """Returns the nested ``[step][rank][microbatch] -> pair indices`` form of :func:`plan_epoch`."""
        with _no_gc():
            if self.max_tokens_per_microbatch is None:
                bounds = self._bounds()
                return [[[row[a:b] for a, b in bounds] for row in step] for step in self.pairs.tolist()]
            ends, counts = np.cumsum(self.sizes, axis=2).tolist(), self.microbatch_counts.tolist()
            return [
                [_cut(row, e[:m]) for row, e in zip(step, step_ends, strict=True)]
                for step, step_ends, m in zip(self.pairs.tolist(), ends, counts, strict=True)
            ]

    def fingerprint(self) -> str:
        """Returns a 16-hex-digit digest of the whole plan (all ranks, layout and budget included)."""
        if self.max_tokens_per_microbatch is None:  # a fixed count: the fingerprint has no budget field
            digest = hashlib.sha256(_FINGERPRINT_VERSION)
            digest.update(np.asarray(self.pairs.shape + self.microbatch_sizes, dtype="<i8").tobytes())
        else:
            digest = hashlib.sha256(_BUDGET_FINGERPRINT_VERSION)
            layout = (*self.pairs.shape, self.max_tokens_per_microbatch)
            digest.update(np.asarray(layout, dtype="<i8").tobytes())
            digest.update(np.ascontiguousarray(self.sizes, dtype="<i8").tobytes())
        digest.update(np.ascontiguousarray(self.pairs, dtype="<i8").tobytes())
        return digest.hexdigest()[:16]

    def _bounds(self) -> list[tuple[int, int]]:
        """``(start, stop)`` slices of a rank row, one per micro-batch (fixed-count plans: the same everywhere)."""
        ends = np.cumsum(self.microbatch_sizes).tolist()
        return list(zip([0, *ends[:-1]], ends, strict=True))


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Millions of small lists: the cyclic collector's passes would dominate building them."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _cut(row: list[int], ends: list[int]) -> list[list[int]]:
    """Splits one rank row at the micro-batch ``ends``."""
    return [row[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]


def microbatch_sizes(pairs_per_rank: int, microbatches: int) -> tuple[int, ...]:
    """Sizes of a rank's micro-batches: as equal as possible, larger ones first.

    Args:
        pairs_per_rank: Pairs per rank per step (``>= microbatches``).
        microbatches: Number of micro-batches.

    Returns:
        ``[microbatches]`` sizes summing to ``pairs_per_rank``, e.g. ``(3, 3, 2)`` for ``(8, 3)``.
    """
    q, r = divmod(pairs_per_rank, microbatches)
    return tuple([q + 1] * r + [q] * (microbatches - r))


def balanced_partition(weights: np.ndarray, parts: int, *, movable: int | None = None) -> np.ndarray:
    """Splits every row into ``parts`` equal-cardinality groups of nearly equal weight (vectorised over rows).

    Two phases, both run on all rows at once (Python loops only over merge/swap rounds, never over rows):

    1. Cardinality-constrained Karmarkar-Karp (balanced largest differencing): items sorted descending are
       cut into ``m = n // parts`` windows of ``parts`` items; each window is a partial partition (one item
       per group); the two partials with the largest spread (max - min load) are merged, heaviest group of one
       with the lightest of the other, until one partial is left.
    2. Swap refinement: while swapping one item of the heaviest group with one item of the lightest group
       lowers the larger of the two loads below the current maximum, do the best such swap. The multiset of
       loads decreases lexicographically at each swap, so this terminates; it is also capped at
       ``4 * parts + 32`` rounds. It mostly helps heavy-tailed costs, where phase 1 alone is weakest.

    Args:
        weights: ``[rows, n]`` non-negative integer weights, ``n`` a multiple of ``parts``.
        parts: Number of groups ``k >= 1``.
        movable: If set, only columns ``< movable`` take part in swaps (padding columns stay where phase 1
            put them, so per-group counts of padding are kept).

    Returns:
        ``[rows, parts, n // parts]`` int64 column indices of each group's items, ascending within a group.
    """
    w = np.asarray(weights, dtype=np.int64)
    rows, n = w.shape
    m = n // parts
    if parts == 1:
        return np.broadcast_to(np.arange(n, dtype=np.int64), (rows, 1, n)).copy()
    order = np.argsort(-w, axis=1, kind="stable")
    windows = np.take_along_axis(w, order, axis=1).reshape(rows, m, parts)
    merges = _differencing_merges(windows)
    # Resolve, newest merge first, how each partial's slots map onto the survivor's slots (= final labels).
    final = np.broadcast_to(np.arange(parts, dtype=np.int64), (rows, m, parts)).copy()
    r = np.arange(rows)[:, None]
    for kept, gone, mapping in reversed(merges):
        final[r[:, 0], gone] = final[r, kept[:, None], mapping]
    labels = np.empty((rows, n), dtype=np.int64)
    np.put_along_axis(labels, order, final.reshape(rows, n), axis=1)
    groups = np.argsort(labels * n + np.arange(n), axis=1).reshape(rows, parts, m)
    _swap_refine(groups, w, n if movable is None else movable, 4 * parts + 32)
    return np.sort(groups, axis=2)


def _swap_refine(groups: np.ndarray, weights: np.ndarray, movable: int, max_rounds: int) -> None:
    """Improves ``groups [rows, k, m]`` (column indices into ``weights [rows, n]``) in place by swaps.

    Each round, for every row still improving, the best swap between the heaviest and the lightest group
    (minimising the larger of their two new loads) is applied if it beats the current maximum load.
    """
    rows, _, m = groups.shape
    active = np.arange(rows)
    for _ in range(max_rounds):
        g = groups[active]
        idx = np.arange(active.size)
        load = np.take_along_axis(weights[active], g.reshape(active.size, -1), axis=1).reshape(g.shape)
        sums = load.sum(axis=2)
        hi, lo = sums.argmax(axis=1), sums.argmin(axis=1)
        delta = load[idx, hi][:, :, None] - load[idx, lo][:, None, :]  # [rows, m (from hi), m (from lo)]
        worse = np.maximum(sums[idx, hi][:, None, None] - delta, sums[idx, lo][:, None, None] + delta)
        pinned = (g[idx, hi] >= movable)[:, :, None] | (g[idx, lo] >= movable)[:, None, :]
        worse = np.where(pinned, np.iinfo(np.int64).max, worse).reshape(active.size, m * m)
        best = worse.argmin(axis=1)
        better = worse[idx, best] < sums[idx, hi]
        if not better.any():
            return
        active, hi, lo = active[better], hi[better], lo[better]
        xi, yi = np.divmod(best[better], m)
        moved = groups[active, hi, xi]
        groups[active, hi, xi] = groups[active, lo, yi]
        groups[active, lo, yi] = moved


def _differencing_merges(windows: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Runs the largest-differencing merges on ``windows [rows, m, k]`` (each window sorted descending).

    Returns:
        ``m - 1`` merges ``(kept [rows], gone [rows], mapping [rows, k])``: partial ``gone`` was merged into
        partial ``kept`` and its slot ``j`` joined slot ``mapping[:, j]`` of ``kept``.
    """
    rows, m, _ = windows.shape
    sums = windows.copy()
    spread = windows[:, :, 0] - windows[:, :, -1]
    r = np.arange(rows)[:, None]
    merges = []
    for _ in range(m - 1):
        # Two largest spreads by argmax (first index on ties): unlike argpartition, whose SIMD variants may
        # order ties differently, this is the same on every machine.
        kept = spread.argmax(axis=1)
        spread[r[:, 0], kept] -= _SPREAD_MASK
        gone = spread.argmax(axis=1)
        spread[r[:, 0], kept] += _SPREAD_MASK
        s_kept, s_gone = sums[r[:, 0], kept], sums[r[:, 0], gone]
        heavy_first = np.argsort(-s_kept, axis=1, kind="stable")
        light_first = np.argsort(s_gone, axis=1, kind="stable")
        merged = s_kept.copy()
        merged[r, heavy_first] += s_gone[r, light_first]
        mapping = np.empty_like(light_first)
        mapping[r, light_first] = heavy_first
        sums[r[:, 0], kept] = merged
        spread[r[:, 0], kept] = merged.max(axis=1) - merged.min(axis=1)
        spread[r[:, 0], gone] = -1
        merges.append((kept, gone, mapping))
    return merges


def check_enough_pairs(
    num_pairs: int,
    *,
    world_size: int,
    pairs_per_rank: int,
    rows: str = "pairs",
    spent: Sequence[tuple[str, str]] = (),
) -> None:
    """Raises ``too_few_pairs`` when ``num_pairs`` cannot fill one optimizer step of ``world_size * pairs_per_rank``
    pairs. It needs only the count, so the trainer also runs it on the raw rows before any model loads (``rows``
    names what was counted).

    Args:
        spent: What took rows away before they were counted, each as ``(what, how to keep them)`` naming the option
            that decides it (``train.py``'s eval split, ``prepare-data``'s rejections): the message names every one.

    Raises:
        ScheduleError: ``too_few_pairs``.
    """
    group = world_size * pairs_per_rank
    if num_pairs < group:
        spent_on = f" ({'; '.join(what for what, _ in spent)})" if spent else ""
        fixes = "".join(f"{fix}, " for _, fix in spent)
        raise ScheduleError(
            "too_few_pairs",
            f"the dataset has {num_pairs} {rows}{spent_on} but one optimizer step needs world_size * "
            f"pairs_per_rank = {world_size} * {pairs_per_rank} = {group} (processes x per_device_train_batch_size x "
            f"gradient_accumulation_steps); add data, {fixes}or lower per_device_train_batch_size, "
            "gradient_accumulation_steps or the number of processes.",
        )


def plan_epoch_array(
    costs: Sequence[int] | np.ndarray,
    *,
    world_size: int,
    pairs_per_rank: int,
    microbatches: int | None = None,
    max_tokens_per_microbatch: int | None = None,
    seed: int,
    epoch: int,
) -> EpochPlan:
    """Plans one epoch; array form of :func:`plan_epoch` (same arguments, same plan).

    Returns:
        An :class:`EpochPlan` with ``pairs [steps, world_size, pairs_per_rank]``.

    Raises:
        ScheduleError: see :func:`plan_epoch`.
    """
    _check_layout(world_size, pairs_per_rank, microbatches, max_tokens_per_microbatch)
    cost = _check_costs(costs)
    _check_seed(seed, epoch)
    if max_tokens_per_microbatch is not None:
        check_budget(cost, max_tokens_per_microbatch)
    group = world_size * pairs_per_rank
    check_enough_pairs(cost.size, world_size=world_size, pairs_per_rank=pairs_per_rank)
    steps = cost.size // group
    perm = np.random.default_rng([seed, epoch]).permutation(cost.size)[: steps * group].reshape(steps, group)
    by_rank = _split_ranks(perm, cost[perm], world_size)  # [steps, W, P]
    flat = by_rank.reshape(steps * world_size, pairs_per_rank)
    if max_tokens_per_microbatch is None:
        assert microbatches is not None, "the layout was validated above: a count or a budget"
        ordered = _split_microbatches(flat, cost[flat], microbatches)
        sizes: np.ndarray = np.broadcast_to(
            np.asarray(list(microbatch_sizes(pairs_per_rank, microbatches))), (steps, world_size, microbatches)
        )
    else:
        columns, sizes = pack_rows(cost[flat], int(max_tokens_per_microbatch), world_size)
        ordered = np.take_along_axis(flat, columns, axis=1)
        sizes = sizes.reshape(steps, world_size, -1)
    return EpochPlan(
        pairs=ordered.reshape(steps, world_size, pairs_per_rank),
        sizes=np.ascontiguousarray(sizes, dtype=np.int64),
        max_tokens_per_microbatch=None if max_tokens_per_microbatch is None else int(max_tokens_per_microbatch),
    )


def plan_epoch(
    costs: Sequence[int],
    *,
    world_size: int,
    pairs_per_rank: int,
    microbatches: int | None = None,
    max_tokens_per_microbatch: int | None = None,
    seed: int,
    epoch: int,
) -> list[list[list[list[int]]]]:
    """Plans one epoch of pair-atomic, cost-balanced batches (algorithm and guarantees: module docstring).

    Give exactly one of ``microbatches`` (fixed count) and ``max_tokens_per_microbatch`` (token budget).

    Args:
        costs: ``[N]`` positive integer cost of each pair (token cost of prompt+chosen plus prompt+rejected).
        world_size: Number of data-parallel ranks (processes).
        pairs_per_rank: Pairs each rank takes per optimizer step (all its micro-batches together).
        microbatches: Micro-batches per rank per step (gradient accumulation steps), ``<= pairs_per_rank``.
        max_tokens_per_microbatch: Token budget ``B``: micro-batches of summed cost ``<= B``, as many per step
            as the rank that needs the most (every cost must be ``<= B``).
        seed: Non-negative shuffling seed.
        epoch: Non-negative epoch number; a different epoch gives a different order.

    Returns:
        ``plan[step][rank][microbatch]`` -> list of pair indices, ``N // (world_size * pairs_per_rank)``
        steps.

    Raises:
        ScheduleError: ``bad_layout``, ``microbatches_exceed_pairs``, ``bad_cost``, ``pair_too_long``,
            ``too_few_pairs`` or ``bad_seed`` (see ``docs/reason_codes.md``).
    """
    return plan_epoch_array(
        costs,
        world_size=world_size,
        pairs_per_rank=pairs_per_rank,
        microbatches=microbatches,
        max_tokens_per_microbatch=max_tokens_per_microbatch,
        seed=seed,
        epoch=epoch,
    ).to_lists()


def _split_ranks(perm: np.ndarray, cost: np.ndarray, world_size: int) -> np.ndarray:
    """Splits each global batch ``perm [steps, G]`` into ``[steps, world_size, G // world_size]``.

    Pairs of a rank keep their order in ``perm``.
    """
    steps, group = perm.shape
    positions = balanced_partition(cost, world_size).reshape(steps, group)
    return np.take_along_axis(perm, positions, axis=1).reshape(steps, world_size, group // world_size)


def _split_microbatches(rank_pairs: np.ndarray, cost: np.ndarray, microbatches: int) -> np.ndarray:
    """Orders each row of ``rank_pairs [rows, P]`` as its ``microbatches`` micro-batches, concatenated.

    Micro-batches follow :func:`microbatch_sizes`: larger ones first, then heavier ones first; pairs inside a
    micro-batch keep their row order.
    """
    rows, per_rank = rank_pairs.shape
    pad = -per_rank % microbatches
    padded = np.concatenate([cost, np.zeros((rows, pad), dtype=cost.dtype)], axis=1)
    # Zero-cost dummies sort last, into the last KK window: at most one per group, and they never move.
    groups = balanced_partition(padded, microbatches, movable=per_rank)  # [rows, M, ceil(P / M)]
    load = np.take_along_axis(padded, groups.reshape(rows, -1), axis=1).reshape(groups.shape).sum(axis=2)
    short = groups[:, :, -1] >= per_rank  # a dummy sorts last in its group
    group_ids = np.broadcast_to(np.arange(microbatches), (rows, microbatches))
    group_order = np.lexsort((group_ids, -load, short), axis=-1)  # full first, then heaviest first
    cols = np.take_along_axis(groups, group_order[:, :, None], axis=1).reshape(rows, -1)
    cols = cols[cols < per_rank].reshape(rows, per_rank)
    return np.take_along_axis(rank_pairs, cols, axis=1)


def is_integer(value: object) -> bool:
    """True for Python/numpy integers (``bool`` excluded)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_layout(world_size: int, pairs_per_rank: int, microbatches: int | None, budget: int | None) -> None:
    if (microbatches is None) == (budget is None):
        raise ScheduleError(
            "bad_layout",
            "give exactly one of microbatches (gradient_accumulation_steps, a fixed count) and "
            f"max_tokens_per_microbatch (a token budget); got microbatches={microbatches!r}, "
            f"max_tokens_per_microbatch={budget!r}.",
        )
    options = {
        "world_size": (world_size, "the number of processes"),
        "pairs_per_rank": (pairs_per_rank, "per_device_train_batch_size x gradient_accumulation_steps"),
        "microbatches": (microbatches, "gradient_accumulation_steps"),
        "max_tokens_per_microbatch": (budget, "max_tokens_per_microbatch"),
    }
    for name, (value, option) in options.items():
        if value is not None and (not is_integer(value) or value < 1):
            raise ScheduleError("bad_layout", f"{name} must be a positive integer, got {value!r}; check {option}.")
    if microbatches is not None and microbatches > pairs_per_rank:
        raise ScheduleError(
            "microbatches_exceed_pairs",
            f"microbatches ({microbatches}, gradient_accumulation_steps) exceeds pairs_per_rank "
            f"({pairs_per_rank}, the pairs each rank takes per optimizer step: per_device_train_batch_size x "
            "gradient_accumulation_steps), so some micro-batch would be empty; lower "
            "gradient_accumulation_steps or raise per_device_train_batch_size to at least 1.",
        )


def check_budget(cost: np.ndarray, budget: int) -> None:
    """Raises ``ScheduleError('pair_too_long')`` when some pair's cost exceeds the micro-batch budget."""
    over = np.flatnonzero(np.asarray(cost) > budget)
    if over.size:
        i = int(over[0])
        raise ScheduleError(
            "pair_too_long",
            f"pair {i} costs {int(cost[i])} tokens (2 x prompt + chosen + rejected), more than "
            f"max_tokens_per_microbatch={budget} ({over.size} pairs do); a pair is never split, so it fits no "
            "micro-batch: raise max_tokens_per_microbatch, or drop / truncate those pairs (max_length, "
            "max_prompt_length) before training.",
        )


def _check_costs(costs: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(costs)
    if arr.ndim != 1:
        raise ScheduleError("bad_cost", f"costs must be a 1-D sequence of integers, got shape {arr.shape}.")
    if arr.size and arr.dtype.kind not in "iu":
        as_int = arr.astype(np.int64) if arr.dtype.kind in "fb" else None
        if arr.dtype.kind == "b" or as_int is None or not np.array_equal(as_int, arr):
            raise ScheduleError("bad_cost", f"costs must be integers (token counts), got dtype {arr.dtype}.")
        arr = as_int
    arr = arr.astype(np.int64, copy=False)
    bad = np.flatnonzero(arr <= 0)
    if bad.size:
        i = int(bad[0])
        raise ScheduleError(
            "bad_cost",
            f"cost of pair {i} is {int(arr[i])} ({bad.size} pairs have a cost <= 0); every pair must have at "
            "least one token; filter empty pairs from the dataset before training.",
        )
    return arr


def _check_seed(seed: int, epoch: int) -> None:
    for name, value in (("seed", seed), ("epoch", epoch)):
        if not is_integer(value) or value < 0:
            raise ScheduleError("bad_seed", f"{name} must be a non-negative integer, got {value!r}.")
