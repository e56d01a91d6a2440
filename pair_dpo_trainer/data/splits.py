"""Deterministic train/eval splits that never share a prompt, and loading them for ``train.py``."""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pair_dpo_trainer.data.normalize import normalize_row, prompt_hash
from pair_dpo_trainer.data.prepared import load_prepared
from pair_dpo_trainer.data.readers import iter_rows, load_rows
from pair_dpo_trainer.errors import PreferenceRowError

T = TypeVar("T")


def split_by_prompt(
    items: Sequence[T], key: Callable[[T], str], *, train_size: int, eval_size: int, seed: int
) -> tuple[list[T], list[T]]:
    """Chooses eval then train items from whole prompt groups, deterministically from ``seed``.

    Groups (items with the same ``key``, a prompt hash) are visited in the order of ``sha256(seed, key)``, which
    depends neither on the input order nor on the Python version. Eval takes every group that fits in its remaining
    need; if it is still short, it takes part of the smallest remaining group (the rest of that group is dropped).
    Train then takes groups in order, the last one possibly in part. A split that cannot be filled comes back short.

    Example:
        >>> train, held_out = split_by_prompt(["a", "a", "b", "c"], key=str, train_size=9, eval_size=2, seed=0)
        >>> sorted(train + held_out) == ["a", "a", "b", "c"] and not set(train) & set(held_out)
        True

    Returns:
        ``(train_items, eval_items)``.
    """
    groups: dict[str, list[T]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    order = sorted(groups, key=lambda h: hashlib.sha256(f"{seed}\0{h}".encode()).hexdigest())
    eval_items: list[T] = []
    rest: list[str] = []
    for group in order:
        if len(eval_items) < eval_size and len(groups[group]) <= eval_size - len(eval_items):
            eval_items.extend(groups[group])
        else:
            rest.append(group)
    if len(eval_items) < eval_size and rest:
        smallest = min(rest, key=lambda h: len(groups[h]))
        rest.remove(smallest)
        eval_items.extend(groups[smallest][: eval_size - len(eval_items)])
    train_items: list[T] = []
    for group in rest:
        if len(train_items) >= train_size:
            break
        train_items.extend(groups[group][: train_size - len(train_items)])
    return train_items, eval_items


def load_train_eval(path: str | Path, *, eval_size: int, seed: int) -> tuple[Sequence[Any], Sequence[Any]]:
    """Rows for training and evaluation from a ``prepare-data`` output directory or from one data file.

    Args:
        path: A ``prepare-data`` output directory (its two splits, as :class:`~pair_dpo_trainer.data.prepared.
            PreparedSplit` objects that the trainer checks against its tokenizer and limits), or a jsonl / json /
            parquet file of preference rows, split here with :func:`split_by_prompt`.
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
    return [rows[i] for i in sorted(train)], [rows[i] for i in sorted(held_out)]


def _prompt_hash(row: Any, where: str) -> str:
    try:
        return prompt_hash(normalize_row(row))
    except PreferenceRowError as exc:
        raise PreferenceRowError(exc.reason_code, f"{where}: {exc.message}") from exc
