"""DP x GA invariance and rank disagreement with 2 real processes (ranks forked by the fork server, gloo on CPU), not
mocked.

One launch runs every 2-process phase (see tests/dist_worker.py); the DP=1 reference runs in this process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.dist_worker import NUM_PAIRS, OBJECTIVE_RUNS, run_layout, run_objectives
from tests.launch import ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # every test reads the module's one 2-process launch (40-60 s)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("dist")
    ranks("dist_worker.py", out_dir)
    return out_dir


@pytest.fixture(scope="module")
def dp1_ga2(tmp_path_factory):
    return run_layout(tmp_path_factory.mktemp("dp1"), "dp1_ga2", world_size=1, ga=2)


@pytest.fixture(scope="module")
def dp1_budget(tmp_path_factory):
    return run_layout(tmp_path_factory.mktemp("dp1b"), "dp1_budget", world_size=1, ga=None, share_prompt=False)


@pytest.fixture(scope="module")
def dp1_ga2_unshared(tmp_path_factory):
    """The first step of ``dp1_ga2`` with each prompt packed twice: the two-rank runs share prompts (the default)."""
    return run_layout(tmp_path_factory.mktemp("dp1u"), "dp1_ga2", world_size=1, ga=2, steps=1, evaluate=False,
                      share_prompt=False)  # fmt: skip


@pytest.mark.parametrize("layout", ["dp2_ga1", "dp2_ga2", "dp2_budget"])
def test_first_step_gradients_match_single_process(two_rank_results, dp1_ga2, dp1_ga2_unshared, layout):
    """Against one process in the same layout and in the other one (shared vs unshared prompts)."""
    other = torch.load(two_rank_results / f"{layout}.pt")
    for single in (dp1_ga2, dp1_ga2_unshared):
        assert set(other["grads"]) == set(single["grads"]) and len(other["grads"]) > 0
        scale = max(float(g.abs().max()) for g in single["grads"].values())
        assert scale > 0
        for name, grad in single["grads"].items():
            diff = float((other["grads"][name] - grad).abs().max())
            assert diff / scale < 1e-6, f"{layout} {name}: max abs diff {diff:.3e} vs scale {scale:.3e}"


@pytest.mark.parametrize("layout", ["dp2_ga1", "dp2_ga2", "dp2_budget"])
def test_five_step_loss_curves_and_parameters_match(two_rank_results, dp1_ga2, layout):
    other = torch.load(two_rank_results / f"{layout}.pt")
    assert len(other["losses"]) == len(dp1_ga2["losses"]) == 5
    assert other["losses"] == pytest.approx(dp1_ga2["losses"], abs=1e-5)
    for name, param in dp1_ga2["params"].items():
        torch.testing.assert_close(other["params"][name], param, atol=1e-5, rtol=0, msg=name)


def test_budget_under_ddp_syncs_once_per_step_and_evaluates_like_one_process(two_rank_results, dp1_budget):
    """Every budget step has 2+ micro-batches per rank, yet DDP all-reduces as often per step as a one-micro-batch
    step (no_sync on all but the last); the budget's eval (fillers on the short rank) equals the one-process eval."""
    budget, ga1 = torch.load(two_rank_results / "dp2_budget.pt"), torch.load(two_rank_results / "dp2_ga1.pt")
    assert min(budget["microbatch_counts"]) >= 2 and len(set(budget["microbatch_counts"])) > 1
    assert len(budget["allreduces"]) == 5 and min(ga1["allreduces"]) > 0
    assert budget["allreduces"] == ga1["allreduces"]
    assert dp1_budget["losses"] == pytest.approx(budget["losses"], abs=1e-5)
    assert budget["eval_fillers"] == [0, 1] and dp1_budget["eval_fillers"] == [0]  # rank 1 ran a weight-0 filler
    for key in ("eval_loss", "eval_rewards/margins", "eval_logps/chosen"):
        assert budget["eval"][key] == pytest.approx(dp1_budget["eval"][key], abs=1e-5), key


@pytest.mark.parametrize("layout", ["dp2_ga1", "dp2_ga2", "dp2_ga2_pre"])
def test_eval_with_weight0_fillers_on_two_ranks_equals_one_process(two_rank_results, dp1_ga2, layout):
    """Fixed-count eval micro-batches: rank 1 runs a weight-0 filler (ZeRO-3 needs equal forwards on every rank), yet
    the pair-weighted metrics over both ranks equal the one-process eval of the same parameters (a filler counted
    with weight 1 would add the longest pair twice); the precomputed reference covers the fillers too."""
    other = torch.load(two_rank_results / f"{layout}.pt")
    assert other["eval_fillers"] == [0, 1] and dp1_ga2["eval_fillers"] == [0]
    for key in ("eval_loss", "eval_rewards/margins", "eval_logps/chosen", "eval_logps/rejected"):
        assert other["eval"][key] == pytest.approx(dp1_ga2["eval"][key], abs=1e-5), key


def test_precomputed_reference_under_ddp_matches_the_online_reference(two_rank_results):
    online = torch.load(two_rank_results / "dp2_ga2.pt")
    precomputed = torch.load(two_rank_results / "dp2_ga2_pre.pt")
    assert precomputed["losses"] == pytest.approx(online["losses"], abs=1e-6)


@pytest.fixture(scope="module")
def objectives_dp1_ga2(tmp_path_factory):
    return run_objectives(tmp_path_factory.mktemp("obj_dp1"), world_size=1, ga=2)


@pytest.mark.slow
@pytest.mark.parametrize("objective", sorted(OBJECTIVE_RUNS))
def test_every_objective_is_invariant_to_the_dp_ga_layout(two_rank_results, objectives_dp1_ga2, objective):
    """(DP=1, GA=2), (DP=2, GA=1), (DP=2, GA=2) and (DP=2, token budget: 2-4 micro-batches per step) on the same
    global batches: the same per-step gradients, loss curve and parameters for every objective (step-level ones
    included: BCO's running mean, AOT's sort and sft's token mean over the optimizer step, TR-DPO's reference sync)."""
    reference = objectives_dp1_ga2[objective]
    assert len(reference["step_grads"]) == 3
    measured = {}  # printed (pytest -s, or junit system-out): the worst relative gradient difference per layout
    for layout in ("ga1", "ga2", "budget"):
        other = torch.load(two_rank_results / f"objectives_dp2_{layout}.pt")[objective]
        for step, grads in enumerate(reference["step_grads"]):  # every step: the state of previous steps matters
            scale = max(float(g.abs().max()) for g in grads.values())
            assert scale > 0
            worst = max(float((other["step_grads"][step][name] - g).abs().max()) for name, g in grads.items())
            assert worst / scale < 1e-5, f"{objective} dp2_{layout} step {step + 1}: {worst:.3e} vs scale {scale:.3e}"
            measured[layout] = max(measured.get(layout, 0.0), worst / scale)
        assert other["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)
        worst = max(float((other["params"][n] - p).abs().max()) for n, p in reference["params"].items())
        assert worst < 1e-6, f"{objective} dp2_{layout}: parameters differ by {worst:.3e}"
    print(f"dp_ga_invariance {objective}: " + ", ".join(f"dp2_{k} {v:.2e}" for k, v in measured.items()))


def test_rank_disagreement_fails_fast_on_every_rank(two_rank_results):
    for rank in (0, 1):
        result = json.loads((two_rank_results / f"disagree_rank{rank}.json").read_text())
        assert result["reason_code"] == "ranks_disagree", result
        assert "same dataset" in result["message"]
        assert result["seconds"] < 60
    assert NUM_PAIRS > 0


def test_ranks_whose_rows_differ_at_equal_costs_refuse_to_train(two_rank_results):
    """Rank 1's data file has chosen and rejected swapped: every pair costs the same, so the schedules agree; the
    digests of the tokenised pairs do not."""
    for rank in (0, 1):
        result = json.loads((two_rank_results / f"disagree_rows_rank{rank}.json").read_text())
        assert result["reason_code"] == "ranks_disagree", result
        assert "train pairs" in result["message"] and "same dataset" in result["message"], result
