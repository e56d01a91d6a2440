"""``samplers/evaluation.py`` on its own: every eval pair exactly once with weight 1, the same number of non-empty
micro-batches on every rank, weight-0 fillers only where a rank runs short, the budget and the pair cap kept."""

from __future__ import annotations

import random

import pytest

from pair_dpo_trainer.errors import ScheduleError
from pair_dpo_trainer.samplers.evaluation import EvalBatchSampler, WeightedPairs, plan_eval


def _plans(costs, world_size, cap, budget=None):
    return [
        plan_eval(costs, world_size=world_size, rank=r, pairs_per_microbatch=cap, max_tokens_per_microbatch=budget)
        for r in range(world_size)
    ]


def test_the_module_docstring_example() -> None:
    costs = [9, 1, 8, 2, 7]
    assert _plans(costs, 2, 2) == [[[(0, 1.0), (4, 1.0)], [(1, 1.0)]], [[(2, 1.0), (3, 1.0)], [(0, 0.0)]]]
    assert _plans(costs, 2, 2, budget=15) == [[[(0, 1.0)], [(4, 1.0), (1, 1.0)]], [[(2, 1.0), (3, 1.0)], [(1, 0.0)]]]


@pytest.mark.parametrize("seed", range(40))
def test_every_pair_once_equal_counts_and_fillers_only_where_short(seed: int) -> None:
    rng = random.Random(seed)
    n, world_size, cap = rng.randint(1, 40), rng.randint(1, 4), rng.randint(1, 5)
    costs = [rng.randint(1, 30) for _ in range(n)]
    budget = rng.choice([None, rng.randint(30, 80)])
    plans = _plans(costs, world_size, cap, budget)
    assert len({len(plan) for plan in plans}) == 1  # equal forwards on every rank (ZeRO-3 collectives)
    real = sorted(i for plan in plans for batch in plan for i, w in batch if w == 1.0)
    assert real == list(range(n))  # every pair exactly once, with weight 1
    for plan in plans:
        for batch in plan:
            assert 1 <= len(batch) <= cap
            weights = {w for _, w in batch}
            assert weights <= {0.0, 1.0}
            if 0.0 in weights:  # a filler is alone in its micro-batch, and is a real pair of the set
                assert len(batch) == 1 and 0 <= batch[0][0] < n
            elif budget is not None:
                assert sum(costs[i] for i, _ in batch) <= budget
        # fillers only after the rank ran out of pairs: its real micro-batches come first
        flags = [batch[0][1] == 0.0 for batch in plan]
        assert flags == sorted(flags)


def test_the_sampler_and_the_weighted_view() -> None:
    dataset = [{"prompt_input_ids": [i]} for i in range(3)]
    sampler = EvalBatchSampler([5, 3, 4], world_size=2, rank=1, pairs_per_microbatch=1)
    batches = list(sampler)
    assert len(sampler) == len(batches) == 2 and batches == [[(2, 1.0)], [(0, 0.0)]]  # filler: the longest pair
    view = WeightedPairs(dataset)
    assert len(view) == 3 and view[(2, 0.0)] == {"prompt_input_ids": [2], "pair_weight": 0.0}
    assert view[(1, 1.0)]["pair_weight"] == 1.0 and "pair_weight" not in dataset[1]


@pytest.mark.parametrize(
    ("costs", "kwargs", "code"),
    [
        ([], {"world_size": 1, "rank": 0, "pairs_per_microbatch": 1}, "too_few_pairs"),
        ([3], {"world_size": 2, "rank": 2, "pairs_per_microbatch": 1}, "bad_layout"),
        ([3], {"world_size": 1, "rank": 0, "pairs_per_microbatch": 0}, "bad_layout"),
        (
            [3, 50],
            {"world_size": 1, "rank": 0, "pairs_per_microbatch": 2, "max_tokens_per_microbatch": 40},
            "pair_too_long",
        ),
    ],
)
def test_bad_layouts_are_refused(costs, kwargs, code) -> None:
    with pytest.raises(ScheduleError) as info:
        plan_eval(costs, **kwargs)
    assert info.value.reason_code == code
