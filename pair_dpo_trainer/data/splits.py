"""Deterministic train/eval splits that never share a prompt, and loading them for ``train.py``."""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from pair_dpo_trainer.data.normalize import normalize_row, prompt_hash
from pair_dpo_trainer.data.prepared import load_prepared
from pair_dpo_trainer.data.readers import iter_rows, load_rows
from pair_dpo_trainer.data.rownames import FileRows, file_row_names
from pair_dpo_trainer.data.tokenize import FEATURE_COLUMNS
from pair_dpo_trainer.errors import ConfigError, PreferenceRowError, ScheduleError

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


EVAL_FRACTION = 0.05
EVAL_FLOOR = 16
EVAL_CAP = 200
AUTO_EVAL = "auto"
"""``train.py --eval_size auto`` (its default for a user's file): hold out :data:`EVAL_FRACTION` of the pairs, at most
:data:`EVAL_CAP`; nothing when that is under :data:`EVAL_FLOOR` pairs (an eval loss of fewer pairs is noise, and a
small file is better spent on training)."""


def resolve_eval_size(eval_size: int | str, num_rows: int) -> int:
    """The pairs to hold out of ``num_rows``: ``eval_size`` itself, or for ``"auto"`` 5% of them (at most 200, none
    when that is under 16).

    Example:
        >>> [resolve_eval_size("auto", n) for n in (150, 400, 2400, 10_000)], resolve_eval_size(30, 150)
        ([0, 20, 120, 200], 30)
    """
    if eval_size != AUTO_EVAL:
        return int(eval_size)
    share = min(EVAL_CAP, round(num_rows * EVAL_FRACTION))
    return share if share >= EVAL_FLOOR else 0


def parse_eval_size(value: Any) -> int | str:
    """``train.py``'s ``--eval_size``: ``"auto"`` or a count of pairs >= 0.

    Raises:
        ConfigError: ``bad_args`` for anything else.
    """
    text = str(value).strip().lower()
    if text == AUTO_EVAL:
        return AUTO_EVAL
    if text.isdigit():
        return int(text)
    raise ConfigError(
        "bad_args",
        f"--eval_size={value!r}: give the number of pairs to hold out for evaluation (0: none), or auto (5% of the "
        f"pairs, at most {EVAL_CAP}; none when that is under {EVAL_FLOOR}).",
    )


@dataclass(frozen=True)
class TrainEval:
    """The train and eval rows of ``train.py``'s dataset, with what the split spent (:meth:`spent`, :meth:`describe`).

    Attributes:
        train / eval: The rows (:class:`~pair_dpo_trainer.data.rownames.FileRows` in file order for a file, the
            :class:`PreparedSplit` objects of a ``prepare-data`` directory).
        source: The dataset path.
        option: The option that sized the eval split (``--eval_size``, ``prepare-data --eval-size``).
        asked: Its value (``auto``, ``200``).
        rows: Rows the dataset had before the split (for a prepared directory: rows read by ``prepare-data``).
        rejected: Rows ``prepare-data`` rejected, per reason code (truncation drops among them).
    """

    train: Sequence[Any]
    eval: Sequence[Any]
    source: str
    option: str
    asked: str
    rows: int
    rejected: Mapping[str, int] = field(default_factory=dict)

    @property
    def dropped(self) -> int:
        """Valid rows in neither split: the rest of the prompt group eval took in part."""
        return self.rows - sum(self.rejected.values()) - len(self.train) - len(self.eval)

    def spent(self) -> list[tuple[str, str]]:
        """What took rows away from training, each with what to change (``too_few_pairs`` names them)."""
        spent = []
        if self.rejected:
            codes = ", ".join(f"{code}: {count}" for code, count in sorted(self.rejected.items()))
            spent.append(
                (
                    f"{sum(self.rejected.values())} rejected by prepare-data ({codes})",
                    "fix the rejected rows (or raise prepare-data's --max-length / --max-prompt-length for pairs "
                    "that truncation dropped)",
                )
            )
        if self.eval:
            held = f"{len(self.eval)} held out for evaluation by {self.option} {self.asked}"
            spent.append((held, f"lower {self.option} (0: none)"))
        if self.dropped:
            also = " (or prepare-data --train-size)" if self.option.startswith("prepare-data") else ""
            spent.append(
                (
                    f"{self.dropped} in neither split: the rest of the prompt group that eval took in part (a prompt "
                    f"is never in both splits){also}",
                    f"change {self.option} (eval then takes whole prompt groups)",
                )
            )
        return spent

    def describe(self) -> str:
        """One line for the run's log: the rows of each split and what the split spent.

        Example:
            >>> TrainEval([0] * 380, [0] * 20, "pairs.jsonl", "--eval_size", "auto", 400).describe()
            'pairs.jsonl: 400 rows: 380 for training, 20 held out for evaluation (--eval_size auto).'
        """
        held = (
            f"{len(self.eval)} held out for evaluation ({self.option} {self.asked})" if self.eval else "none held out"
        )
        if not self.eval and self.asked == AUTO_EVAL:
            held += f" (--eval_size auto holds out 5% when that is at least {EVAL_FLOOR} pairs; --eval_size N: N)"
        dropped = (
            f", {self.dropped} in neither split (the rest of a prompt group eval took in part)" if self.dropped else ""
        )
        return f"{self.source}: {self.rows} rows: {len(self.train)} for training, {held}{dropped}."


def load_train_eval(path: str | Path, *, eval_size: int | str, seed: int) -> TrainEval:
    """Rows for training and evaluation from a ``prepare-data`` output directory or from one data file.

    Args:
        path: A ``prepare-data`` output directory (its two splits, as :class:`~pair_dpo_trainer.data.prepared.
            PreparedSplit` objects that the trainer checks against its tokenizer and limits), or a jsonl / json /
            parquet file of preference rows (raw, or pre-tokenised: the three ``*_input_ids`` columns, whose
            ``prompt_input_ids`` then group the prompts), split here with :func:`split_by_prompt`; its rows keep their
            file lines (:class:`~pair_dpo_trainer.data.rownames.FileRows`) for messages.
        eval_size: Pairs held out when ``path`` is a file (0: no eval split; ``"auto"``: :func:`resolve_eval_size`).
        seed: Split seed.

    Raises:
        PreferenceRowError: a row that cannot be normalised (its prompt is needed to keep the splits apart), named by
            its file and line.
        ConfigError: ``bad_manifest`` for a directory that is not a valid ``prepare-data`` output.
    """
    root = Path(path)
    if root.is_dir():
        train_split, eval_split = load_prepared(root, "train"), load_prepared(root, "eval")
        manifest = train_split.manifest
        rejected = {code: count for code, count in manifest.get("rejections", {}).items() if count}
        asked = str(manifest.get("eval_size"))
        rows_read = int(manifest.get("rows_read", 0))
        return TrainEval(train_split, eval_split, str(path), "prepare-data --eval-size", asked, rows_read, rejected)
    with tempfile.TemporaryDirectory(prefix="pair-dpo-datasets-") as cache_dir:
        rows = list(iter_rows(load_rows(str(root), cache_dir)))
    names = file_row_names(path, len(rows))
    hashes = [_prompt_hash(row, names(index)) for index, row in enumerate(rows)]
    held = resolve_eval_size(eval_size, len(rows))
    indices = list(range(len(rows)))
    train, held_out = split_by_prompt(indices, hashes.__getitem__, train_size=len(rows), eval_size=held, seed=seed)
    if rows and not train:
        _eval_took_every_prompt(root, len(rows), len(set(hashes)), len(held_out), held)
    train, held_out = sorted(train), sorted(held_out)
    return TrainEval(
        FileRows([rows[i] for i in train], names.subset(train)),
        FileRows([rows[i] for i in held_out], names.subset(held_out)),
        str(path),
        "--eval_size",
        str(eval_size),
        len(rows),
    )


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
