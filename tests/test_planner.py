"""Invariants of the pure epoch planner (``pair_dpo_trainer.samplers.planner``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pair_dpo_trainer.errors import ScheduleError
from pair_dpo_trainer.samplers import balanced_partition, microbatch_sizes, plan_epoch, plan_epoch_array

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def length_mix(n: int, seed: int, sigma: float = 0.9) -> np.ndarray:
    """Realistic pair costs: prompt U[32, 512], chosen/rejected clip(lognormal(log 200, sigma), 16, 1024)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(32, 513, n)
    chosen, rejected = (np.clip(rng.lognormal(np.log(200), sigma, n), 16, 1024).astype(np.int64) for _ in "cr")
    return 2 * prompt + chosen + rejected


def check_structure(plan, n: int, world_size: int, pairs_per_rank: int, microbatches: int) -> list[int]:
    """Asserts shape, counts and atomicity; returns the flat list of planned indices."""
    group = world_size * pairs_per_rank
    assert len(plan) == n // group
    sizes = microbatch_sizes(pairs_per_rank, microbatches)
    flat = []
    for step in plan:
        assert len(step) == world_size
        for rank in step:
            assert len(rank) == microbatches
            assert [len(mb) for mb in rank] == list(sizes)
            assert all(len(mb) > 0 for mb in rank)
            assert max(map(len, rank)) - min(map(len, rank)) <= 1
            for mb in rank:
                assert all(type(i) is int for i in mb)
                flat.extend(mb)
    assert len(flat) == len(set(flat)) == (n // group) * group  # every index at most once; only remainder dropped
    assert all(0 <= i < n for i in flat)
    return flat


@st.composite
def problems(draw):
    world_size = draw(st.integers(1, 8))
    pairs_per_rank = draw(st.integers(1, 6))
    microbatches = draw(st.integers(1, pairs_per_rank))
    n = draw(st.integers(world_size * pairs_per_rank, 4 * world_size * pairs_per_rank + 7))
    costs = draw(st.lists(st.integers(1, 5000), min_size=n, max_size=n))
    return (
        costs,
        world_size,
        pairs_per_rank,
        microbatches,
        draw(st.integers(0, 2**32)),
        draw(st.integers(0, 50)),
    )


@SETTINGS
@given(problems())
def test_invariants_random(problem):
    costs, world_size, pairs_per_rank, microbatches, seed, epoch = problem
    kwargs = dict(world_size=world_size, pairs_per_rank=pairs_per_rank, microbatches=microbatches, seed=seed)
    plan = plan_epoch(costs, epoch=epoch, **kwargs)
    check_structure(plan, len(costs), world_size, pairs_per_rank, microbatches)
    assert plan == plan_epoch(list(costs), epoch=epoch, **kwargs)  # deterministic
    assert plan == plan_epoch(np.asarray(costs), epoch=epoch, **kwargs)


@SETTINGS
@given(st.data())
def test_layout_invariance(data):
    group = data.draw(st.sampled_from([1, 2, 4, 6, 8, 12, 16, 24, 32]))
    n = data.draw(st.integers(group, 5 * group + 3))
    costs = data.draw(st.lists(st.integers(1, 3000), min_size=n, max_size=n))
    seed, epoch = data.draw(st.integers(0, 10_000)), data.draw(st.integers(0, 5))
    divisors = [w for w in range(1, 9) if group % w == 0]
    reference = None
    for world_size in data.draw(st.lists(st.sampled_from(divisors), min_size=2, max_size=3)):
        pairs_per_rank = group // world_size
        microbatches = data.draw(st.integers(1, pairs_per_rank))
        plan = plan_epoch(
            costs,
            world_size=world_size,
            pairs_per_rank=pairs_per_rank,
            microbatches=microbatches,
            seed=seed,
            epoch=epoch,
        )
        step_sets = [frozenset(i for rank in step for mb in rank for i in mb) for step in plan]
        reference = step_sets if reference is None else reference
        assert step_sets == reference


def test_epochs_change_order_and_dropped_set():
    costs = length_mix(103, seed=3)
    kwargs = dict(world_size=2, pairs_per_rank=5, microbatches=2, seed=7)
    plans = [plan_epoch(costs, epoch=e, **kwargs) for e in range(6)]
    dropped = []
    for plan in plans:
        flat = check_structure(plan, 103, 2, 5, 2)
        dropped.append(frozenset(range(103)) - frozenset(flat))
        assert len(dropped[-1]) == 3
    assert len(set(dropped)) > 1
    for a, b in zip(plans, plans[1:], strict=False):
        assert a != b
    assert plan_epoch(costs, epoch=0, **dict(kwargs, seed=8)) != plans[0]


def test_dropped_are_tail_of_epoch_permutation():
    costs = [5] * 23
    plan = plan_epoch(costs, world_size=2, pairs_per_rank=2, microbatches=1, seed=11, epoch=4)
    perm = np.random.default_rng([11, 4]).permutation(23)
    flat = {i for step in plan for rank in step for mb in rank for i in mb}
    assert set(range(23)) - flat == set(perm[20:].tolist())
    for s, step in enumerate(plan):
        assert {i for rank in step for mb in rank for i in mb} == set(perm[4 * s : 4 * s + 4].tolist())


def rank_ratios(costs: np.ndarray, plan) -> tuple[np.ndarray, np.ndarray]:
    """Per step max/mean over ranks, and per (step, rank) max/mean over micro-batches."""
    rank_load = np.array([[sum(costs[i] for mb in rank for i in mb) for rank in step] for step in plan])
    mb_load = np.array([[[costs[mb].sum() for mb in rank] for rank in step] for step in plan])
    return rank_load.max(1) / rank_load.mean(1), (mb_load.max(2) / mb_load.mean(2)).ravel()


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("pairs_per_rank", [8, 16])
@pytest.mark.parametrize("sigma", [0.9, 1.5])
def test_balance_vs_random_assignment(world_size, pairs_per_rank, sigma):
    costs = length_mix(world_size * pairs_per_rank * 60 + 5, seed=world_size + pairs_per_rank, sigma=sigma)
    plan = plan_epoch(costs, world_size=world_size, pairs_per_rank=pairs_per_rank, microbatches=2, seed=0, epoch=0)
    ranks, mbs = rank_ratios(costs, plan)
    # Random assignment of the same global batches to ranks and micro-batches.
    rng = np.random.default_rng(1)
    shuffled = [rng.permutation([i for rank in step for mb in rank for i in mb]) for step in plan]
    rand_plan = [[np.split(chunk, 2) for chunk in np.split(step, world_size)] for step in shuffled]
    rand_ranks, rand_mbs = rank_ratios(costs, rand_plan)
    assert np.median(ranks) <= 1.05
    assert np.median(ranks) - 1 < (np.median(rand_ranks) - 1) / 4
    assert np.median(mbs) <= 1.05
    assert np.median(mbs) - 1 < (np.median(rand_mbs) - 1) / 2


def test_microbatch_split_heaviest_first_and_uneven_sizes():
    costs = length_mix(7 * 3 * 10, seed=5)
    plan = plan_epoch(costs, world_size=3, pairs_per_rank=7, microbatches=3, seed=2, epoch=1)
    assert microbatch_sizes(7, 3) == (3, 2, 2)
    for step in plan:
        for rank in step:
            loads = [int(costs[mb].sum()) for mb in rank]
            assert loads[1] >= loads[2]  # same size class: heavier first


@pytest.mark.parametrize("parts,m", [(1, 5), (2, 1), (3, 4), (5, 3), (8, 8)])
def test_balanced_partition_cardinality(parts, m):
    weights = np.random.default_rng(parts * m).lognormal(5, 1.5, size=(40, parts * m)).astype(np.int64) + 1
    groups = balanced_partition(weights, parts)
    assert groups.shape == (40, parts, m)
    for row in groups:
        assert sorted(row.ravel().tolist()) == list(range(parts * m))
        assert all(list(g) == sorted(g) for g in row.tolist())


def test_balanced_partition_finds_perfect_split():
    weights = np.array([[8, 7, 6, 5, 4, 3, 2, 1]])
    groups = balanced_partition(weights, 2)[0]
    assert weights[0, groups[0]].sum() == weights[0, groups[1]].sum() == 18


def test_swap_refinement_on_heavy_tail_and_pinned_columns():
    weights = np.array([[1000, 1, 1, 1, 1, 1, 990, 5]])
    groups = balanced_partition(weights, 2)[0]
    assert sorted(weights[0, g].sum() for g in groups) == [997, 1003]  # optimal: 1000 + three 1s
    rows = np.random.default_rng(9).pareto(1.2, size=(200, 24)).astype(np.int64) * 100 + 1
    for weight, row in zip(rows, balanced_partition(rows, 4), strict=True):
        loads = weight[row].sum(axis=1)
        hi, lo = weight[row[loads.argmax()]], weight[row[loads.argmin()]]
        delta = hi[:, None] - lo[None, :]
        assert np.maximum(loads.max() - delta, loads.min() + delta).min() >= loads.max()  # swap-local optimum
    pinned = balanced_partition(np.array([[9, 8, 7, 6, 5, 0]]), 3, movable=5)[0]
    assert sorted(int(g[-1] == 5) for g in pinned) == [0, 0, 1]


def test_docstring_example():
    plan = plan_epoch([10, 1, 1, 10, 5, 5, 3, 7], world_size=2, pairs_per_rank=4, microbatches=2, seed=0, epoch=0)
    assert plan == [[[[2, 3], [6, 7]], [[0, 1], [4, 5]]]]


def test_fingerprint():
    costs = length_mix(500, seed=0)
    kwargs = dict(world_size=4, pairs_per_rank=8, microbatches=2, seed=3)
    a = plan_epoch_array(costs, epoch=0, **kwargs)
    assert a.fingerprint() == plan_epoch_array(costs, epoch=0, **kwargs).fingerprint()
    assert len(a.fingerprint()) == 16 and int(a.fingerprint(), 16) >= 0
    assert a.fingerprint() != plan_epoch_array(costs, epoch=1, **kwargs).fingerprint()
    assert a.fingerprint() != plan_epoch_array(costs, epoch=0, **dict(kwargs, microbatches=4)).fingerprint()
    assert a.to_lists() == plan_epoch(costs, epoch=0, **kwargs)


LAYOUT = dict(world_size=2, pairs_per_rank=4, microbatches=2, seed=0, epoch=0)


@pytest.mark.parametrize(
    "costs,overrides,code,words",
    [
        ([5] * 16, dict(microbatches=5), "microbatches_exceed_pairs", ["gradient_accumulation_steps"]),
        ([5] * 7, {}, "too_few_pairs", ["per_device_train_batch_size", "7"]),
        ([5] * 15 + [0], {}, "bad_cost", ["pair 15"]),
        ([5] * 15 + [-3], {}, "bad_cost", ["pair 15"]),
        ([5.5] * 16, {}, "bad_cost", ["integers"]),
        ([[5, 5]] * 16, {}, "bad_cost", ["1-D"]),
        ([5] * 16, dict(world_size=0), "bad_layout", ["world_size"]),
        ([5] * 16, dict(pairs_per_rank=-1), "bad_layout", ["per_device_train_batch_size"]),
        ([5] * 16, dict(microbatches=0), "bad_layout", ["gradient_accumulation_steps"]),
        ([5] * 16, dict(world_size=2.0), "bad_layout", ["world_size"]),
        ([5] * 16, dict(seed=-1), "bad_seed", ["seed"]),
        ([5] * 16, dict(epoch=None), "bad_seed", ["epoch"]),
    ],
)
def test_errors(costs, overrides, code, words):
    with pytest.raises(ScheduleError) as info:
        plan_epoch(costs, **dict(LAYOUT, **overrides))
    assert info.value.reason_code == code
    for word in words:
        assert word in str(info.value)


def test_integral_float_costs_accepted():
    assert plan_epoch([5.0] * 8, **LAYOUT) == plan_epoch([5] * 8, **LAYOUT)


def test_exact_step_has_no_drop():
    plan = plan_epoch(list(range(1, 33)), world_size=4, pairs_per_rank=8, microbatches=8, seed=1, epoch=0)
    assert sorted(check_structure(plan, 32, 4, 8, 8)) == list(range(32))


# --------------------------------------------------------------------------------------------- token budget
def heavy_mix(n: int, seed: int) -> np.ndarray:
    """bench_sampler.py's "heavy" mix: prompt clip(lognormal(log 300, 1), 16, 4096), completions
    clip(lognormal(log 150, 1.5), 8, 4096)."""
    rng = np.random.default_rng(seed)
    prompt = np.clip(rng.lognormal(np.log(300), 1.0, n), 16, 4096).astype(np.int64)
    chosen, rejected = (np.clip(rng.lognormal(np.log(150), 1.5, n), 8, 4096).astype(np.int64) for _ in "cr")
    return 2 * prompt + chosen + rejected


def ffd_count(costs: list[int], budget: int) -> int:
    """Independent first-fit decreasing: bins needed for ``costs`` under ``budget``."""
    bins: list[int] = []
    for c in sorted(costs, reverse=True):
        for j, load in enumerate(bins):
            if load + c <= budget:
                bins[j] += c
                break
        else:
            bins.append(c)
    return len(bins)


def check_budget_plan(plan, costs, world_size: int, pairs_per_rank: int, budget: int) -> None:
    """Every invariant of a budget plan, checked against the costs and an independent FFD."""
    costs = np.asarray(costs)
    n, group = len(costs), world_size * pairs_per_rank
    assert len(plan) == n // group
    flat = []
    for step in plan:
        assert len(step) == world_size
        counts = {len(rank) for rank in step}
        assert len(counts) == 1  # the same number of micro-batches on every rank of the step
        needed = [ffd_count(costs[[i for mb in rank for i in mb]].tolist(), budget) for rank in step]
        assert counts == {max(needed)}  # M_step = the most any rank of the step needs (FFD)
        for rank in step:
            assert sum(len(mb) for mb in rank) == pairs_per_rank
            loads = [int(costs[mb].sum()) for mb in rank]
            assert all(len(mb) > 0 for mb in rank) and max(loads) <= budget
            assert loads == sorted(loads, reverse=True)  # heaviest micro-batch first
            for mb in rank:
                assert all(type(i) is int for i in mb)
                flat.extend(mb)
    assert len(flat) == len(set(flat)) == (n // group) * group
    assert all(0 <= i < n for i in flat)


@st.composite
def budget_problems(draw):
    world_size = draw(st.integers(1, 6))
    pairs_per_rank = draw(st.integers(1, 9))
    n = draw(st.integers(world_size * pairs_per_rank, 3 * world_size * pairs_per_rank + 5))
    costs = draw(st.lists(st.integers(1, 400), min_size=n, max_size=n))
    budget = draw(st.integers(max(costs), max(costs) * pairs_per_rank + 1))
    return costs, world_size, pairs_per_rank, budget, draw(st.integers(0, 2**32)), draw(st.integers(0, 20))


@SETTINGS
@given(budget_problems())
def test_budget_invariants_random(problem):
    costs, world_size, pairs_per_rank, budget, seed, epoch = problem
    kwargs = dict(world_size=world_size, pairs_per_rank=pairs_per_rank, max_tokens_per_microbatch=budget, seed=seed)
    plan = plan_epoch(costs, epoch=epoch, **kwargs)
    check_budget_plan(plan, costs, world_size, pairs_per_rank, budget)
    assert plan == plan_epoch(np.asarray(costs), epoch=epoch, **kwargs)  # deterministic
    # The same global batches (as sets) and the same rank shares as the fixed-count plan: only micro-batching differs.
    fixed = plan_epoch(costs, epoch=epoch, microbatches=1, **{k: v for k, v in kwargs.items() if "tokens" not in k})
    assert [[sorted(i for mb in rank for i in mb) for rank in step] for step in plan] == [
        [sorted(rank[0]) for rank in step] for step in fixed
    ]


@pytest.mark.parametrize("mix", ["lognormal", "heavy"])
@pytest.mark.parametrize("world_size,pairs_per_rank", [(1, 32), (2, 16), (3, 8), (8, 4)])
@pytest.mark.parametrize("budget", [4096, 16384])
def test_budget_plans_on_length_mixes(mix, world_size, pairs_per_rank, budget):
    costs = length_mix(world_size * pairs_per_rank * 12 + 3, seed=7) if mix == "lognormal" else None
    if costs is None:
        costs = np.minimum(heavy_mix(world_size * pairs_per_rank * 12 + 3, seed=7), budget)
    kwargs = dict(world_size=world_size, pairs_per_rank=pairs_per_rank, max_tokens_per_microbatch=budget, seed=1)
    plan = plan_epoch(costs, epoch=2, **kwargs)
    check_budget_plan(plan, costs, world_size, pairs_per_rank, budget)
    array = plan_epoch_array(costs, epoch=2, **kwargs)
    assert array.to_lists() == plan and array.microbatch_counts.tolist() == [len(step[0]) for step in plan]
    for rank in range(world_size):
        assert array.rank_microbatches(rank) == [step[rank] for step in plan]


def test_budget_splits_a_rank_whose_balanced_split_would_break_the_budget():
    # Rank costs [6, 4, 4, 3, 3] under 10 tokens: FFD needs 2 micro-batches (6+4, 4+3+3); longest-first into 2
    # gives 6+3 / 4+4+3 = 11 > 10, so the rank keeps FFD's packing. Its partner [9, 1, 1, 1, 1] needs 2 as well.
    costs = [6, 4, 4, 3, 3]
    plan = plan_epoch(costs, world_size=1, pairs_per_rank=5, max_tokens_per_microbatch=10, seed=0, epoch=0)
    (step,) = plan
    assert sorted(sorted(costs[i] for i in mb) for mb in step[0]) == [[3, 3, 4], [4, 6]]
    # Three ranks of one pair each but a rank needing 3 micro-batches: the others split to 3 (non-empty).
    costs = [9, 9, 9, 1, 1, 1, 1, 1, 1]
    plan = plan_epoch(costs, world_size=3, pairs_per_rank=3, max_tokens_per_microbatch=10, seed=0, epoch=0)
    for step in plan:
        check_budget_plan(plan, costs, 3, 3, 10)
        assert [len(rank) for rank in step] == [len(step[0])] * 3


def test_budget_counts_vary_by_step_and_fit_exactly():
    costs = [10, 10, 10, 10, 1, 1, 1, 1] * 4
    plan = plan_epoch(costs, world_size=2, pairs_per_rank=2, max_tokens_per_microbatch=20, seed=4, epoch=0)
    check_budget_plan(plan, costs, 2, 2, 20)
    assert all(len(step[0]) == 1 for step in plan)  # two pairs of <= 20 tokens fit one micro-batch exactly
    plan = plan_epoch(costs, world_size=2, pairs_per_rank=2, max_tokens_per_microbatch=19, seed=4, epoch=0)
    counts = [len(step[0]) for step in plan]
    assert set(counts) == {1, 2}  # steps where some rank holds 10 + 10 need two micro-batches everywhere


@pytest.mark.integration
def test_budget_plan_of_a_million_heavy_tailed_pairs_keeps_the_budget():
    costs = heavy_mix(1_000_000, seed=0)  # the heaviest pair costs at most 2 * 4096 + 4096 + 4096 = 16384
    plan = plan_epoch_array(costs, world_size=8, pairs_per_rank=32, max_tokens_per_microbatch=16384, seed=0, epoch=0)
    assert plan.steps == 1_000_000 // 256 and (plan.sizes.sum(axis=2) == 32).all()
    assert sorted(plan.pairs.ravel().tolist()) == sorted(set(plan.pairs.ravel().tolist()))
    rows, sizes = plan.pairs.reshape(-1, 32), plan.sizes.reshape(-1, plan.sizes.shape[2])
    ends = np.cumsum(sizes, axis=1)
    prefix = np.concatenate([np.zeros((rows.shape[0], 1), dtype=np.int64), np.cumsum(costs[rows], axis=1)], axis=1)
    loads = np.take_along_axis(prefix, ends, 1) - np.take_along_axis(prefix, ends - sizes, 1)
    assert loads.max() <= 16384 and (loads > 0).sum(axis=1).tolist() == np.repeat(plan.microbatch_counts, 8).tolist()


def test_budget_fingerprint_and_fixed_fingerprints_unchanged():
    costs = np.random.default_rng(0).integers(20, 3000, 500).tolist()
    frozen = {  # plan_epoch_array(...).fingerprint() before token budgets existed: fixed-count plans are unchanged
        (4, 8, 2): "e900fb79e2d76d49",
        (3, 7, 3): "330b4a7280f39bfa",
        (1, 5, 5): "b038c83e31fb532d",
    }
    for (world_size, pairs_per_rank, microbatches), digest in frozen.items():
        layout = dict(world_size=world_size, pairs_per_rank=pairs_per_rank, microbatches=microbatches)
        assert plan_epoch_array(costs, seed=3, epoch=1, **layout).fingerprint() == digest
    budget = dict(world_size=4, pairs_per_rank=8, seed=3, epoch=1)
    a = plan_epoch_array(costs, max_tokens_per_microbatch=6000, **budget)
    assert a.fingerprint() == plan_epoch_array(costs, max_tokens_per_microbatch=6000, **budget).fingerprint()
    assert a.fingerprint() != plan_epoch_array(costs, max_tokens_per_microbatch=6001, **budget).fingerprint()
    assert a.fingerprint() not in frozen.values()
    with pytest.raises(ValueError):
        a.microbatch_sizes  # noqa: B018  (a budget plan has no common sizes)


def test_budget_docstring_example():
    costs = [10, 1, 1, 10, 5, 5, 3, 7]
    plan = plan_epoch(costs, world_size=2, pairs_per_rank=4, max_tokens_per_microbatch=12, seed=0, epoch=0)
    assert plan == [[[[2, 3], [6, 7]], [[0, 1], [4, 5]]]]


@pytest.mark.parametrize(
    "overrides,code,words",
    [
        (dict(max_tokens_per_microbatch=9), "pair_too_long", ["pair 0", "10 tokens", "max_tokens_per_microbatch=9"]),
        (dict(max_tokens_per_microbatch=0), "bad_layout", ["max_tokens_per_microbatch"]),
        (dict(max_tokens_per_microbatch=12.5), "bad_layout", ["max_tokens_per_microbatch"]),
        (dict(max_tokens_per_microbatch=12, microbatches=2), "bad_layout", ["exactly one"]),
        (dict(microbatches=None), "bad_layout", ["exactly one"]),
    ],
)
def test_budget_errors(overrides, code, words):
    layout = dict(world_size=2, pairs_per_rank=4, seed=0, epoch=0, microbatches=None)
    if "microbatches" in overrides:
        layout["microbatches"] = overrides.pop("microbatches")
    with pytest.raises(ScheduleError) as info:
        plan_epoch([10, 1, 1, 10, 5, 5, 3, 7], **layout, **overrides)
    assert info.value.reason_code == code
    for word in words:
        assert word in str(info.value)
