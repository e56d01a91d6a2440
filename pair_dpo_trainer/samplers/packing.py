"""Token-budget micro-batches: each rank's pairs of a step packed into micro-batches of at most ``B`` tokens.

The budget half of :func:`~pair_dpo_trainer.samplers.planner.plan_epoch` (pure numpy, vectorised over all
``steps * world_size`` rank rows at once; the Python loops run over the ``P`` pair slots of a row and over split
rounds, never over steps or pairs):

Details: samplers/README.md, "Module notes", ``packing.py``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["pack_rows"]

_UNUSABLE = np.iinfo(np.int64).max // 4  # load of a micro-batch slot a row does not have (never the lightest)


def pack_rows(cost: np.ndarray, budget: int, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Packs every rank row into micro-batches of summed cost ``<= budget``, equal counts within each step.

    Args:
        cost: ``[rows, P]`` int64 pair costs, ``rows = steps * world_size`` in step-major order (the rows of one
            step are consecutive), every cost ``<= budget``.
        budget: Token budget ``B`` of one micro-batch.
        world_size: Ranks per step.

    Returns:
        ``(columns, sizes)``: ``columns [rows, P]`` int64, the row's positions reordered as its micro-batches
        concatenated (heaviest micro-batch first, row order inside one); ``sizes [rows, M_max]`` int64 pairs per
        micro-batch in that order, 0 past the step's ``M_step`` (equal for all rows of a step).
    """
    rows, per_rank = cost.shape
    order = np.argsort(-cost, axis=1, kind="stable")  # heaviest first; ties by position
    sorted_cost = np.take_along_axis(cost, order, axis=1)
    ffd_labels, needed = _first_fit_decreasing(sorted_cost, budget)
    target = np.repeat(needed.reshape(-1, world_size).max(axis=1), world_size)  # M_step for every row
    labels, max_load = _longest_first(sorted_cost, target)
    tight = np.flatnonzero(max_load > budget)
    if tight.size:
        labels[tight] = _split_until(ffd_labels[tight], needed[tight], target[tight])
    by_position = np.empty_like(labels)
    np.put_along_axis(by_position, order, labels, axis=1)
    return _ordered(by_position, cost, int(target.max()))


def _first_fit_decreasing(sorted_cost: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """FFD over rows of costs sorted descending: ``(labels [rows, P] micro-batch of each slot, counts [rows])``.

    Micro-batches open in order, so a row's used ones are ``0 .. count - 1``; only the first ``width`` columns
    (one more than the most any row uses so far) are searched.
    """
    rows, per_rank = sorted_cost.shape
    loads = np.zeros((rows, per_rank), dtype=np.int64)
    labels = np.empty((rows, per_rank), dtype=np.int64)
    index, width = np.arange(rows), 1
    for slot in range(per_rank):
        c = sorted_cost[:, slot]
        first = (loads[:, :width] + c[:, None] <= budget).argmax(axis=1)  # column width-1 is empty in every row
        loads[index, first] += c
        labels[:, slot] = first
        if width < per_rank and (first == width - 1).any():
            width += 1
    return labels, (loads > 0).sum(axis=1)


def _longest_first(sorted_cost: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """LPT into exactly ``target[r]`` micro-batches per row: ``(labels [rows, P], max load [rows])``.

    The first ``target[r]`` pairs open one micro-batch each (empty ones are the lightest), so none stays empty.
    """
    rows, per_rank = sorted_cost.shape
    slots = int(target.max())
    loads = np.where(np.arange(slots)[None, :] < target[:, None], 0, _UNUSABLE).astype(np.int64)
    labels = np.empty((rows, per_rank), dtype=np.int64)
    index = np.arange(rows)
    for slot in range(per_rank):
        lightest = loads.argmin(axis=1)
        loads[index, lightest] += sorted_cost[:, slot]
        labels[:, slot] = lightest
    return labels, np.where(loads >= _UNUSABLE, 0, loads).max(axis=1)


def _split_until(labels: np.ndarray, counts: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Splits each row's fullest micro-batch until it has ``target`` of them (labels over cost-sorted slots).

    The fullest micro-batch (most pairs, first on ties) has at least two pairs while ``count < target <= P``;
    every second of its pairs (by cost, heaviest first) moves to the new micro-batch ``count``.
    """
    labels, counts = labels.copy(), counts.copy()
    rows, per_rank = labels.shape
    while True:
        short = np.flatnonzero(counts < target)
        if not short.size:
            return labels
        sub = labels[short]
        offsets = np.arange(short.size)[:, None] * per_rank
        members = np.bincount((sub + offsets).ravel(), minlength=short.size * per_rank).reshape(-1, per_rank)
        fullest = members.argmax(axis=1)
        inside = sub == fullest[:, None]
        move = inside & (np.cumsum(inside, axis=1) % 2 == 0)  # the 2nd, 4th, ... member
        labels[short] = np.where(move, counts[short][:, None], sub)
        counts[short] += 1


def _ordered(labels: np.ndarray, cost: np.ndarray, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Row positions grouped by micro-batch (heaviest first, empty ones last) and the sizes of the groups."""
    rows, per_rank = labels.shape
    flat = (labels + np.arange(rows)[:, None] * per_rank).ravel()
    loads = np.bincount(flat, weights=cost.ravel(), minlength=rows * per_rank).reshape(rows, per_rank)
    counts = np.bincount(flat, minlength=rows * per_rank).reshape(rows, per_rank)
    rank_of = np.empty_like(counts)
    by_load = np.argsort(-loads, axis=1, kind="stable")  # empty micro-batches (load 0) sort last
    np.put_along_axis(rank_of, by_load, np.arange(per_rank)[None, :].repeat(rows, axis=0), axis=1)
    key = np.take_along_axis(rank_of, labels, axis=1) * per_rank + np.arange(per_rank)[None, :]
    columns = np.argsort(key, axis=1, kind="stable")
    sizes = np.take_along_axis(counts, by_load, axis=1)[:, :slots]
    return columns.astype(np.int64), sizes.astype(np.int64)
