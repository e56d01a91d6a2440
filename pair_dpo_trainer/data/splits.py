"""Deterministic train/eval splits that never share a prompt, and loading them for ``train.py``."""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from pair_dpo_trainer.data.normalize import normalize_row, prompt_hash
from pair_dpo_trainer.data.prepared import load_prepared
from pair_dpo_trainer.data.readers import iter_rows, load_rows
from pair_dpo_trainer.data.tokenize import FEATURE_COLUMNS
from pair_dpo_trainer.errors import PreferenceRowError, ScheduleError

T = TypeVar("T")


SPLIT_KEY_BYTES = 32
"""Bytes of a prompt group's visiting key (a SHA-256 digest)."""


def split_key(seed: int, prompt_hash: str) -> bytes:
    """The key that orders a prompt group in :func:`split_by_prompt`: ``sha256(f"{seed}\\0{prompt_hash}")``.

    Ordering by the digest's bytes is ordering by its hex digest; neither depends on the input order nor on the Python
    version. ``prepare-data``'s workers compute it for each row, so the split itself only sorts.
    """
    return hashlib.sha256(f"{seed}\0{prompt_hash}".encode()).digest()


def split_by_prompt(
    items: Sequence[T], key: Callable[[T], str], *, train_size: int, eval_size: int, seed: int
) -> tuple[list[T], list[T]]:
    """Chooses eval then train items from whole prompt groups, deterministically from ``seed``.

    Groups (items with the same ``key``, a prompt hash) are visited in the order of :func:`split_key`; the choice is
    :func:`split_groups`'. A split that cannot be filled comes back short.

    Example:
        >>> train, held_out = split_by_prompt(["a", "a", "b", "c"], key=str, train_size=9, eval_size=2, seed=0)
        >>> sorted(train + held_out) == ["a", "a", "b", "c"] and not set(train) & set(held_out)
        True

    Returns:
        ``(train_items, eval_items)``, each in group visiting order (a group's items in input order).
    """
    group_ids: dict[str, int] = {}
    group_of_item = np.fromiter((group_ids.setdefault(key(item), len(group_ids)) for item in items), np.int64)
    keys = b"".join(split_key(seed, name) for name in group_ids)
    train, held_out = split_groups(
        group_of_item, group_keys(keys, len(group_ids)), train_size=train_size, eval_size=eval_size
    )
    return [items[i] for i in train.tolist()], [items[i] for i in held_out.tolist()]


def group_keys(digests: bytes | memoryview, count: int) -> np.ndarray:
    """``count`` concatenated :func:`split_key` digests as a ``uint64 [count, 4]`` array: each digest's big-endian
    words, so that the rows compare as the digests' bytes do."""
    words = np.frombuffer(digests, dtype=">u8", count=count * SPLIT_KEY_BYTES // 8)
    return words.astype(np.uint64).reshape(count, 4)


def split_groups(
    group_of_row: np.ndarray, keys: np.ndarray, *, train_size: int, eval_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """The train and eval rows of a split by whole prompt groups, vectorised (no Python object per row).

    Groups are visited in ascending key order (ties, which only a SHA-256 collision makes, by group number). Eval takes
    every group that fits in its remaining need; if it is still short, it takes the first rows of the smallest
    remaining group (the first such in visiting order; the rest of that group is dropped; its rows come last in
    eval). Train then takes groups in order, the last one possibly in part. A split that cannot be filled comes back
    short.

    Args:
        group_of_row: ``int64 [rows]``: each row's group number, ``0 .. groups - 1``.
        keys: ``uint64 [groups, 4]``: each group's :func:`split_key` as big-endian words (:func:`group_keys`).
        train_size: Train rows wanted.
        eval_size: Eval rows wanted.

    Returns:
        ``(train_rows, eval_rows)``: ``int64`` row numbers, each in group visiting order (a group's rows in input
        order).
    """
    num_groups = len(keys)
    sizes = np.bincount(group_of_row, minlength=num_groups).astype(np.int64)
    order = _visiting_order(keys)
    eval_take, rest, partial = _eval_groups(sizes[order], eval_size)
    train_take = np.zeros(num_groups, np.int64)
    rest_sizes = sizes[order[rest]]
    train_take[order[rest]] = np.clip(train_size - (np.cumsum(rest_sizes) - rest_sizes), 0, rest_sizes)
    eval_by_group = np.zeros(num_groups, np.int64)
    eval_by_group[order] = eval_take
    rank = np.empty(num_groups, np.int64)
    rank[order] = np.arange(num_groups)
    eval_rank = rank.copy()
    if partial is not None:  # the partial group is taken last, after the whole ones
        eval_rank[order[partial]] = num_groups
    position = _position_in_group(group_of_row, sizes)
    return (
        _rows_in_visiting_order(position < train_take[group_of_row], group_of_row, rank),
        _rows_in_visiting_order(position < eval_by_group[group_of_row], group_of_row, eval_rank),
    )


def _visiting_order(keys: np.ndarray) -> np.ndarray:
    """Group numbers by ascending key (ties by number): a stable sort of the first word, all four where it ties."""
    order = np.argsort(keys[:, 0], kind="stable")
    first = keys[order, 0]
    if len(first) > 1 and bool(np.any(first[1:] == first[:-1])):
        order = np.lexsort((np.arange(len(keys)), keys[:, 3], keys[:, 2], keys[:, 1], keys[:, 0]))
    return order


def _eval_groups(sizes_in_order: np.ndarray, eval_size: int) -> tuple[np.ndarray, np.ndarray, int | None]:
    """Eval's rows taken from each group (in visiting order), the positions of the groups left for train, and the
    position of the group eval took in part (None if none)."""
    take = np.zeros(len(sizes_in_order), np.int64)
    need = eval_size
    for position, size in enumerate(sizes_in_order.tolist()):  # greedy: stops once eval is full
        if need == 0:
            break
        if size <= need:
            take[position], need = size, need - size
    rest = np.flatnonzero(take == 0)
    if need == 0 or not len(rest):
        return take, rest, None
    smallest = int(rest[np.argmin(sizes_in_order[rest])])
    take[smallest] = need
    return take, rest[rest != smallest], smallest


def _position_in_group(group_of_row: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Each row's 0-based position among its group's rows, in input order."""
    by_group = np.argsort(group_of_row, kind="stable")
    position = np.empty(len(group_of_row), np.int64)
    position[by_group] = np.arange(len(group_of_row)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    return position


def _rows_in_visiting_order(selected: np.ndarray, group_of_row: np.ndarray, rank: np.ndarray) -> np.ndarray:
    rows = np.flatnonzero(selected)
    return rows[np.argsort(rank[group_of_row[rows]], kind="stable")]


def load_train_eval(path: str | Path, *, eval_size: int, seed: int) -> tuple[Sequence[Any], Sequence[Any]]:
    """Rows for training and evaluation from a ``prepare-data`` output directory or from one data file.

    Args:
        path: A ``prepare-data`` output directory (its two splits, as :class:`~pair_dpo_trainer.data.prepared.
            PreparedSplit` objects that the trainer checks against its tokenizer and limits), or a jsonl / json /
            parquet file of preference rows (raw, or pre-tokenised: the three ``*_input_ids`` columns, whose
            ``prompt_input_ids`` then group the prompts), split here with :func:`split_by_prompt`.
        eval_size: Pairs held out when ``path`` is a file (0: no eval split).
        seed: Split seed.

    Raises:
        PreferenceRowError: a row that cannot be normalised (its prompt is needed to keep the splits apart).
        ConfigError: ``bad_manifest`` for a directory that is not a valid ``prepare-data`` output.
    """
    root = Path(path)
    if root.is_dir():
        return load_prepared(root, "train"), load_prepared(root, "eval")
    with tempfile.TemporaryDirectory(prefix="pair-dpo-datasets-") as cache_dir:
        rows = list(iter_rows(load_rows(str(root), cache_dir)))
    hashes = [_prompt_hash(row, f"{root.name} row {number}") for number, row in enumerate(rows, start=1)]
    indices = list(range(len(rows)))
    train, held_out = split_by_prompt(indices, hashes.__getitem__, train_size=len(rows), eval_size=eval_size, seed=seed)
    if rows and not train:
        _eval_took_every_prompt(root, len(rows), len(set(hashes)), len(held_out), eval_size)
    return [rows[i] for i in sorted(train)], [rows[i] for i in sorted(held_out)]


def _eval_took_every_prompt(root: Path, num_rows: int, num_prompts: int, num_eval: int, eval_size: int) -> None:
    """Raises ``too_few_pairs`` saying why no row is left to train on: train and eval never share a prompt."""
    one = num_prompts == 1
    groups = "the only prompt group (every row has the same prompt)" if one else f"all {num_prompts} prompt groups"
    raise ScheduleError(
        "too_few_pairs",
        f"{root.name}: the eval split (eval_size={eval_size}) took {groups}, so none of the {num_rows} rows is left to "
        f"train on ({num_eval} held out; the rest of a group eval took in part is dropped, since train and eval never "
        "share a prompt). Set --eval_size 0, or add rows with other prompts.",
    )


def _prompt_hash(row: Any, where: str) -> str:
    if isinstance(row, Mapping) and all(column in row for column in FEATURE_COLUMNS):  # pre-tokenised: by its ids
        ids = json.dumps(row["prompt_input_ids"], default=repr, separators=(",", ":"))
        return hashlib.sha256(f"prompt_input_ids {ids}".encode()).hexdigest()
    try:
        return prompt_hash(normalize_row(row))
    except PreferenceRowError as exc:
        raise PreferenceRowError(exc.reason_code, f"{where}: {exc.message}") from exc
