"""The split by prompt groups (``data/splits.py``): the vectorised ``split_groups`` chooses exactly what the
sequential greedy of its docstring chooses, written here independently, one Python object per row."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from pair_dpo_trainer.data.arrow import binary_values
from pair_dpo_trainer.data.splits import group_keys, split_by_prompt, split_groups, split_key


def _sequential(keys: list[str], *, train_size: int, eval_size: int, seed: int) -> tuple[list[int], list[int]]:
    """The docstring's greedy, one row at a time: groups by ``sha256(seed NUL key)`` hex digest."""
    groups: dict[str, list[int]] = {}
    for row, key in enumerate(keys):
        groups.setdefault(key, []).append(row)
    order = sorted(groups, key=lambda h: hashlib.sha256(f"{seed}\0{h}".encode()).hexdigest())
    held_out: list[int] = []
    rest = []
    for group in order:
        if len(held_out) < eval_size and len(groups[group]) <= eval_size - len(held_out):
            held_out.extend(groups[group])
        else:
            rest.append(group)
    if len(held_out) < eval_size and rest:
        smallest = min(rest, key=lambda h: len(groups[h]))
        rest.remove(smallest)
        held_out.extend(groups[smallest][: eval_size - len(held_out)])
    train: list[int] = []
    for group in rest:
        if len(train) >= train_size:
            break
        train.extend(groups[group][: train_size - len(train)])
    return train, held_out


@settings(max_examples=400, deadline=None)
@given(
    labels=st.lists(st.integers(0, 12), max_size=60),
    train_size=st.integers(0, 70),
    eval_size=st.integers(0, 30),
    seed=st.integers(0, 3),
)
def test_split_by_prompt_is_the_sequential_greedy(labels, train_size, eval_size, seed):
    keys = [f"prompt-{label}" for label in labels]
    rows = list(range(len(keys)))
    got = split_by_prompt(rows, keys.__getitem__, train_size=train_size, eval_size=eval_size, seed=seed)
    assert got == _sequential(keys, train_size=train_size, eval_size=eval_size, seed=seed)


def test_split_groups_orders_by_every_byte_of_the_key_and_by_group_on_a_tie():
    digests = [bytes(8) + bytes([9]) + bytes(23), bytes(8) + bytes([3]) + bytes(23), bytes(32), bytes(32)]
    keys = group_keys(b"".join(digests), 4)  # the first 8 bytes tie: the later words decide, then the group number
    train, held_out = split_groups(np.arange(4), keys, train_size=4, eval_size=0)
    assert train.tolist() == [2, 3, 1, 0] and held_out.tolist() == []


def test_split_key_orders_as_its_hex_digest():
    names = [f"h{i}" for i in range(200)]
    by_bytes = sorted(names, key=lambda h: split_key(7, h))
    assert by_bytes == sorted(names, key=lambda h: hashlib.sha256(f"7\0{h}".encode()).hexdigest())


def test_binary_values_is_the_concatenated_values():
    array = pa.array([b"ab", b"", b"cde", b"f"], pa.binary())
    for view in (array, array.slice(1), array.slice(2, 1), array.slice(0, 0), array.filter([True, False, True, True])):
        assert bytes(binary_values(view)) == b"".join(view.to_pylist())


def _pairs_file(path, n: int, *, prompts: int | None = None):
    """``n`` JSON lines, one distinct prompt each (or ``prompts`` prompts shared in turn)."""
    import json

    lines = [json.dumps({"prompt": f"q{i % (prompts or n)}", "chosen": f"a{i}", "rejected": f"b{i}"}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_a_users_file_holds_out_five_percent_at_most_200_and_nothing_when_that_is_under_16(tmp_path):
    from pair_dpo_trainer.data.splits import load_train_eval

    got = {}
    for n in (150, 319, 320, 400, 2400, 5000):
        split = load_train_eval(_pairs_file(tmp_path / f"{n}.jsonl", n), eval_size="auto", seed=0)
        got[n] = (len(split.train), len(split.eval))
    share = {n: min(200, round(n / 20)) for n in got}  # 5% of the pairs, capped at 200
    assert got == {n: (n - s, s) if s >= 16 else (n, 0) for n, s in share.items()}
    assert got[150] == (150, 0) and got[400] == (380, 20)  # a small file trains on every row
    assert load_train_eval(tmp_path / "400.jsonl", eval_size=30, seed=0).eval.__len__() == 30  # asked: exactly


def test_the_split_says_what_it_held_out_and_what_dropped_rows(tmp_path):
    from pair_dpo_trainer.data.splits import load_train_eval

    split = load_train_eval(_pairs_file(tmp_path / "a.jsonl", 400), eval_size="auto", seed=0)
    assert (
        split.describe() == f"{tmp_path / 'a.jsonl'}: 400 rows: 380 for training, 20 held out for evaluation "
        "(--eval_size auto)."
    )
    grouped = load_train_eval(_pairs_file(tmp_path / "g.jsonl", 40, prompts=4), eval_size=5, seed=0)  # groups of 10
    assert (len(grouped.train), len(grouped.eval), grouped.dropped) == (30, 5, 5)
    spent = [what for what, _ in grouped.spent()]
    assert spent == [
        "5 held out for evaluation by --eval_size 5",
        "5 in neither split: the rest of the prompt group that eval took in part (a prompt is never in both splits)",
    ]
