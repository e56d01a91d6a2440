"""``PairBatchSampler``: one rank's view of the plan, DataLoader use and exact resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from accelerate.data_loader import SkipBatchSampler, skip_first_batches

from pair_dpo_trainer.collators import PackedPairCollator
from pair_dpo_trainer.collators.step import StepBatch, StepCollator, StepPairs
from pair_dpo_trainer.errors import ScheduleError
from pair_dpo_trainer.samplers import PairBatchSampler, PairStepSampler, plan_epoch
from pair_dpo_trainer.samplers import sampler as sampler_module

N = 203
COSTS = np.random.default_rng(0).integers(50, 3000, N).tolist()
LAYOUT = dict(world_size=3, pairs_per_rank=6, microbatches=4, seed=5)


def make(rank: int = 0, **overrides) -> PairBatchSampler:
    return PairBatchSampler(COSTS, rank=rank, **dict(LAYOUT, **overrides))


class PairDataset(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> dict:
        return {"pair": index, "cost": COSTS[index]}


def test_sizes_and_lengths():
    sampler = make()
    assert sampler.global_pairs_per_step == 18
    assert sampler.steps_per_epoch == N // 18 == 11
    assert len(sampler) == 11 * 4
    assert sampler.step_pair_count(0) == sampler.step_pair_count(10) == 18
    batches = list(sampler)
    assert len(batches) == len(sampler)
    assert [len(b) for b in batches[:4]] == [2, 2, 1, 1]
    assert all(isinstance(b, list) and all(type(i) is int for i in b) for b in batches)


@pytest.mark.parametrize("epoch", [0, 3])
def test_ranks_reassemble_the_plan(epoch):
    plan = plan_epoch(COSTS, epoch=epoch, **LAYOUT)
    for rank in range(3):
        sampler = make(rank)
        sampler.set_epoch(epoch)
        expected = [mb for step in plan for mb in step[rank]]
        assert list(sampler) == expected
        assert list(sampler) == expected  # re-iterable
        assert sampler.rank_plan() == [step[rank] for step in plan]


def test_set_epoch_changes_order_and_plans_once(monkeypatch):
    calls = []
    real = sampler_module.plan_epoch_array

    def counting(*args, **kwargs):
        calls.append(kwargs["epoch"])
        return real(*args, **kwargs)

    monkeypatch.setattr(sampler_module, "plan_epoch_array", counting)
    sampler = make()
    first = list(sampler)
    list(sampler)
    sampler.schedule_fingerprint()
    assert calls == [0]
    sampler.set_epoch(1)
    second = list(sampler)
    list(sampler)
    assert calls == [0, 1]
    assert first != second
    assert sorted(len(b) for b in first) == sorted(len(b) for b in second)


@pytest.mark.parametrize("start", [0, 1, 5, 10, 11])
def test_set_start_step_yields_exact_tail(start):
    sampler = make(rank=1)
    sampler.set_epoch(2)
    full = list(sampler)
    sampler.set_start_step(start)
    assert list(sampler) == full[start * 4 :]
    assert list(sampler) == full  # one-shot: the next iteration starts at step 0 again
    # A fresh sampler (a restarted process) resumes identically.
    resumed = make(rank=1)
    resumed.set_epoch(2)
    resumed.set_start_step(start)
    assert list(resumed) == full[start * 4 :]
    assert len(resumed) == len(full)


def test_dataloader_batch_sampler():
    sampler = make(rank=2)
    loader = torch.utils.data.DataLoader(PairDataset(), batch_sampler=sampler, collate_fn=list)
    assert len(loader) == len(sampler)
    got = [[row["pair"] for row in batch] for batch in loader]
    assert got == list(sampler)


@pytest.mark.parametrize("skip", [0, 3, 8, 44])
def test_accelerate_skip_batch_sampler(skip):
    sampler = make(rank=0)
    full = list(sampler)
    wrapped = SkipBatchSampler(sampler, skip_batches=skip)
    assert list(wrapped) == full[skip:]
    assert len(wrapped) == len(full) - skip
    loader = torch.utils.data.DataLoader(PairDataset(), batch_sampler=sampler, collate_fn=list)
    skipped = skip_first_batches(loader, num_batches=skip)
    assert [[row["pair"] for row in batch] for batch in skipped] == full[skip:]


def test_fingerprint_agrees_across_ranks():
    prints = {make(rank).schedule_fingerprint(4) for rank in range(3)}
    assert len(prints) == 1
    assert make().schedule_fingerprint(4) != make().schedule_fingerprint(5)
    assert make(seed=6).schedule_fingerprint(4) not in prints
    sampler = make()
    sampler.set_epoch(4)
    assert sampler.schedule_fingerprint() in prints


def test_errors():
    with pytest.raises(ScheduleError) as info:
        make(rank=3)
    assert info.value.reason_code == "bad_layout"
    with pytest.raises(ScheduleError) as info:
        make(microbatches=7)
    assert info.value.reason_code == "microbatches_exceed_pairs"
    with pytest.raises(ScheduleError) as info:
        PairBatchSampler(COSTS[:10], rank=0, **LAYOUT)
    assert info.value.reason_code == "too_few_pairs"
    sampler = make()
    for bad in (-1, 12):
        with pytest.raises(ScheduleError) as info:
            sampler.set_start_step(bad)
        assert info.value.reason_code == "step_out_of_range"
    with pytest.raises(ScheduleError) as info:
        sampler.step_pair_count(11)
    assert info.value.reason_code == "step_out_of_range"


# --------------------------------------------------------------------------------------------- token budget
BUDGET = dict(world_size=3, pairs_per_rank=6, max_tokens_per_microbatch=6000, seed=5)


def make_steps(rank: int = 0, **overrides) -> PairStepSampler:
    return PairStepSampler(COSTS, rank=rank, **dict(BUDGET, **overrides))


@pytest.mark.parametrize("epoch", [0, 3])
def test_step_sampler_yields_whole_steps_of_the_plan(epoch):
    plan = plan_epoch(COSTS, epoch=epoch, **BUDGET)
    counts = [len(step[0]) for step in plan]
    assert len(set(counts)) > 1  # the budget gives steps different micro-batch counts
    for rank in range(3):
        sampler = make_steps(rank)
        sampler.set_epoch(epoch)
        assert len(sampler) == sampler.steps_per_epoch == len(plan) == N // 18
        assert list(sampler) == [step[rank] for step in plan] == list(sampler)
        assert sampler.microbatch_counts() == counts
        assert sampler.step_pair_count(0) == 18
    fixed = PairStepSampler(COSTS, rank=1, microbatches=4, **{k: v for k, v in LAYOUT.items() if k != "microbatches"})
    assert list(fixed) == [list(make(1))[4 * s : 4 * s + 4] for s in range(11)]  # fixed count: same micro-batches


def test_step_sampler_resume_and_skip_batch_sampler_skip_whole_steps():
    sampler = make_steps(rank=2)
    full = list(sampler)
    sampler.set_start_step(4)
    assert list(sampler) == full[4:]
    assert list(SkipBatchSampler(make_steps(rank=2), skip_batches=4)) == full[4:]
    assert make_steps(rank=0).schedule_fingerprint() == make_steps(rank=2).schedule_fingerprint()
    assert make_steps().schedule_fingerprint() != make_steps(max_tokens_per_microbatch=6001).schedule_fingerprint()


def test_step_items_through_a_dataloader_with_step_pairs_and_collator():
    features = [
        {"prompt_input_ids": [5] * (c % 7 + 1), "chosen_input_ids": [6, 2], "rejected_input_ids": [7, 8, 2]}
        for c in COSTS
    ]
    sampler = make_steps(rank=1)
    loader = torch.utils.data.DataLoader(
        StepPairs(features), batch_sampler=sampler, collate_fn=StepCollator(PackedPairCollator())
    )
    skipped = skip_first_batches(loader, num_batches=2)
    for loader_, expected in ((loader, list(sampler)), (skipped, list(sampler)[2:])):
        steps = list(loader_)
        assert [len(step) for step in steps] == [len(step) for step in expected]
        for step, keys in zip(steps, expected, strict=True):
            assert isinstance(step, StepBatch) and step.num_pairs == sum(map(len, keys))
            for batch, mb in zip(step.microbatches, keys, strict=True):
                assert batch.num_tokens == sum(2 * len(features[i]["prompt_input_ids"]) + 5 for i in mb)


def test_pair_batch_sampler_refuses_a_budget():
    with pytest.raises(ScheduleError) as info:
        PairBatchSampler(COSTS, rank=0, **BUDGET)
    assert info.value.reason_code == "bad_layout" and "PairStepSampler" in str(info.value)
    with pytest.raises(ScheduleError) as info:
        make_steps(max_tokens_per_microbatch=100)
    assert info.value.reason_code == "pair_too_long"
