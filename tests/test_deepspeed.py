"""DeepSpeed ZeRO-3 with 2 real processes on the CPU (``accelerate launch``, gloo, fp32), not mocked.

One launch runs every phase (see tests/ds_worker.py); the single-process DP=1 runs without DeepSpeed run here. The
DeepSpeed config sets ``stage3_param_persistence_threshold: 0`` so that the tiny models are really partitioned (the
default keeps parameters below 1e5 elements whole), and leaves the other values ``"auto"``. DeepSpeed builds its
shared-memory C++ extension on the first launch of a machine (about a minute), cached in ``TORCH_EXTENSIONS_DIR``.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest
import torch

from pair_dpo_trainer.integrity import parameter_digest
from tests.dpo_fixtures import synthetic_pairs
from tests.ds_worker import STEPS, build_trainer, losses, run_budget
from tests.launch import accelerate_launch
from tests.models import tiny_lora_llama
from tests.ports import free_port

pytest.importorskip("deepspeed", reason="DeepSpeed is part of the test extra: pip install -e '.[test]'")
pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # every test reads the module's one ZeRO-3 launch (40-60 s)
ROOT = Path(__file__).resolve().parents[1]

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
    },
}

ACCELERATE_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: {ds_config}
  zero3_init_flag: false
num_machines: 1
num_processes: 2
machine_rank: 0
main_process_ip: 127.0.0.1
main_process_port: {port}
use_cpu: true
rdzv_backend: static
same_network: true
"""


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    """Runs tests/ds_worker.py once on 2 ranks; returns (rank-0 results, per-rank error results)."""
    root = tmp_path_factory.mktemp("zero3")
    (root / "ds_config.json").write_text(json.dumps(DS_CONFIG))
    config = root / "accelerate.yaml"
    config.write_text(ACCELERATE_CONFIG.format(ds_config=root / "ds_config.json", port=free_port()))
    out = root / "out"
    out.mkdir()
    extensions = os.environ.get("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "pair_dpo_torch_extensions"))
    start = time.monotonic()
    accelerate_launch(config, "ds_worker.py", out, env={"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": extensions})
    results = torch.load(out / "results.pt", weights_only=False)
    results["timings"]["launch"] = round(time.monotonic() - start, 1)
    print(f"\nZeRO-3 launch timings (s): {results['timings']}")
    errors = [json.loads((out / f"errors_rank{rank}.json").read_text()) for rank in (0, 1)]
    return results, errors


@pytest.fixture(scope="module")
def dp1(tmp_path_factory):
    """The same runs in one process without DeepSpeed (DP=1 x GA=2, same global batch)."""
    root = tmp_path_factory.mktemp("dp1")
    runs = {}
    for name, options in (("free", {"reference_free": True}), ("std", {}), ("peft", {"model": tiny_lora_llama(0)})):
        trainer = build_trainer(root / name, world_size=1, **options)
        trainer.train()
        runs[name] = {"losses": losses(trainer), "params": dict(trainer.model.named_parameters())}
    runs["budget"] = run_budget(root, world_size=1)
    return runs


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b) and len(a) > 0
    return max(float((a[name].detach() - b[name].detach()).abs().max()) for name in a)


@pytest.mark.parametrize("mode", ["free", "std"])
def test_zero3_dp2_matches_dp1_without_deepspeed(zero3, dp1, mode):
    results, _ = zero3
    assert len(results[mode]["losses"]) == len(dp1[mode]["losses"]) == 6
    assert results[mode]["losses"] == pytest.approx(dp1[mode]["losses"], abs=1e-5)
    if mode == "std":  # Adam divides by sqrt(v): 1e-7 reduction-order noise in tiny gradients grows to ~2e-5
        assert _max_diff(results[mode]["params"], dp1[mode]["params"]) < 1e-4


def test_token_budget_under_zero3_matches_dp1_and_steps_the_engine_once_per_step(zero3, dp1):
    """A varying number of micro-batches per step (equal on both ranks) under ZeRO-3: no hang, the engine's
    accumulation boundary only at each step's last micro-batch, and DP=1's losses, parameters and eval."""
    results, _ = zero3
    budget = results["budget"]
    assert min(budget["microbatch_counts"]) >= 2 and len(set(budget["microbatch_counts"])) > 1
    assert budget["engine_steps"] == [STEPS, STEPS]  # DeepSpeed stepped (and counted) once per optimizer step
    for reference in (dp1["std"], dp1["budget"]):  # DP=1 x GA=2, and DP=1 with the budget: the same global batch
        assert budget["losses"] == pytest.approx(reference["losses"], abs=1e-5)
        assert _max_diff(budget["params"], reference["params"]) < 1e-4  # Adam-amplified reduction-order noise
    for key in ("eval_loss", "eval_rewards/margins", "eval_logps/chosen"):
        assert budget["eval"][key] == pytest.approx(dp1["budget"]["eval"][key], abs=1e-4), key


def test_sequence_parallel_group_under_zero3_matches_one_process(zero3, tmp_path):
    """The two ranks as one sequence-parallel group (each computes half of every row; a pair longer than one rank's
    budget included) under ZeRO-3: losses, parameters and eval of one process without DeepSpeed (tests/sp_worker.py's
    run)."""
    from tests.sp_worker import EVAL_PAIRS as SP_EVAL_PAIRS
    from tests.sp_worker import one_process

    results, _ = zero3
    group = results["sequence_parallel"]
    one = one_process(tmp_path, pairs_per_step=4, eval_pairs=synthetic_pairs(SP_EVAL_PAIRS, seed=9))
    assert group["microbatch_counts"] == one["microbatch_counts"]
    assert group["losses"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert group["losses"] == pytest.approx(one["losses"], abs=1e-5)
    assert _max_diff(group["params"], one["params"]) < 1e-4
    for key in ("eval_loss", "eval_rewards/margins", "eval_logps/chosen"):
        assert group["eval"][key] == pytest.approx(one["eval"][key], abs=1e-5), key


def test_both_models_are_partitioned_the_reference_is_frozen_and_unchanged(zero3):
    results, _ = zero3
    std = results["std"]
    assert std["losses"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert std["policy_is_engine"] == "DeepSpeedEngine"
    policy, reference = std["policy_partitioning"], std["reference_partitioning"]
    assert policy["count"] > 0 and policy["sliced"] == policy["count"] and policy["frozen"] == 0
    assert reference["sliced"] == reference["frozen"] == reference["count"] == policy["count"]
    assert std["reference_zero_stage"] == 3 and std["reference_training"] is False
    before, after = std["reference_digest"]
    assert before == after and before is not None


def test_leaf_decoder_layers_have_no_hooks_inside_and_train_exactly_like_per_submodule_hooks(zero3):
    """zero3_leaf_modules="auto" (std) makes both engines' decoder layers ZeRO-3 leaves: DeepSpeed hooks only
    outside them. "none" (noleaf) hooks every submodule. The runs are the same computation: equal losses and
    parameters; with gradient checkpointing too."""
    results, _ = zero3
    std, noleaf = results["std"], results["noleaf"]
    for part in (std["policy_partitioning"], std["reference_partitioning"]):
        assert part["leaf_classes"] == ["LlamaDecoderLayer"] and part["leaves"] == 2  # tiny_llama: 2 layers
        assert part["hooked_inside_leaves"] == 0 and part["hooked_outside_leaves"] > 0
    hooked_with_leaves = std["policy_partitioning"]["hooked_outside_leaves"]
    for part in (noleaf["policy_partitioning"], noleaf["reference_partitioning"]):
        assert part["leaves"] == 0 and part["hooked_outside_leaves"] > hooked_with_leaves
    assert noleaf["losses"] == pytest.approx(std["losses"], abs=1e-6)
    assert results["checkpointed"]["losses"] == pytest.approx(std["losses"], abs=1e-6)  # leaves recomputed in backward
    assert _max_diff(noleaf["params"], std["params"]) < 1e-4  # other gradient bucketing: Adam-amplified 1e-7 noise


def test_lora_policy_under_zero3_gets_no_leaves_and_matches_dp1(zero3, dp1):
    """DeepSpeed reduces a leaf's gradients before LoRA weight gradients are accumulated (backward fails), so "auto"
    gives a PEFT policy per-submodule hooks; the run then matches DP=1 without DeepSpeed."""
    results, _ = zero3
    peft_run = results["peft"]
    assert peft_run["leaf_classes"] == [] and peft_run["policy_partitioning"]["leaves"] == 0
    assert peft_run["losses"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert peft_run["losses"] == pytest.approx(dp1["peft"]["losses"], abs=1e-5)


def test_resume_under_zero3_equals_the_uninterrupted_run(zero3):
    results, _ = zero3
    std = results["std"]
    for name in ("resume", "pre_resume"):
        assert results[name]["losses"] == pytest.approx(std["losses"][3:], abs=1e-6), name
        assert _max_diff(results[name]["params"], std["params"]) <= 1e-6, name
        assert parameter_digest(results[name]["params"].items()) == parameter_digest(std["params"].items()), name


def test_precomputed_reference_matches_online_and_its_cache_is_reused(zero3):
    results, _ = zero3
    pre = results["pre"]
    assert pre["losses"] == pytest.approx(results["std"]["losses"], abs=1e-6)
    assert pre["builds"] == 1 and pre["backend"] == "PrecomputedReference"
    assert len(pre["cache_files"]) == 1
    assert results["pre_resume"]["builds"] == 0  # the resume read the cache: the reference was never built


@pytest.mark.parametrize(
    ("phase", "code"),
    [("tamper", "reference_changed"), ("disagree", "ranks_disagree"), ("disagree_pre", "ranks_disagree")],
)
def test_a_changed_reference_or_disagreeing_ranks_fail_fast_on_every_rank(zero3, phase, code):
    _, errors = zero3
    for rank, result in enumerate(errors):
        assert result[phase]["reason_code"] == code, (rank, result[phase])
        assert result[phase]["seconds"] < 60 and result[phase]["step"] == 0  # nothing restored, no step ran


def test_torch_compile_under_zero3_is_refused_on_every_rank(zero3):
    """Refused with every reason at once (run_checks): ZeRO-3, and on a CPU also the host-synced SDPA kernel."""
    _, errors = zero3
    for rank, result in enumerate(errors):
        problems = result["compile"]["problems"]
        assert [code for code, _ in problems] == ["unsupported_combination"] * 2, (rank, problems)
        assert result["compile"]["reason_code"] == "invalid_config", (rank, result["compile"])
        assert "ZeRO-3" in problems[0][1] and "torch_compile" in problems[0][1]
        assert "sdpa_segments" in problems[1][1] and "torch_compile" in problems[1][1]


def test_pinned_snapshot_under_zero3_is_verified_and_a_changed_one_is_refused_on_resume(zero3):
    _, errors = zero3
    for rank, result in enumerate(errors):
        pinned = result["pinned"]
        assert pinned["identity_pinned"] is True
        assert pinned["losses"][0] == pytest.approx(math.log(2), abs=1e-6)
        reference = pinned["reference_partitioning"]
        assert reference["sliced"] == reference["frozen"] == reference["count"] > 0
        assert pinned["tamper"]["reason_code"] == "reference_changed", (rank, pinned["tamper"])
        assert "manifest" in pinned["tamper"]["message"]


def _assert_replicated(result: dict, rank: int) -> None:
    """A stage 0 reference engine whose parameters are whole (no ZeRO-3 attributes) and frozen on this rank."""
    reference = result["reference"]
    assert reference["zero_stage"] == 0, (rank, reference)
    assert reference["ds_params"] == 0 and reference["frozen"] == reference["count"] > 0, (rank, reference)
    assert reference["numel"] == reference["policy_numel"] > 0, (rank, reference)  # whole, not a slice
    assert len(result["reference_logps"]) == 8  # 4 pairs: chosen and rejected
    assert result["reference_logps"] == pytest.approx(result["sharded_logps"], abs=1e-6), rank


def test_replicated_reference_under_a_zero3_policy_equals_the_sharded_one_and_resumes_its_run(zero3):
    results, errors = zero3
    replicated, std = results["replicated"], results["std"]
    assert replicated["policy_partitioning"]["sliced"] == replicated["policy_partitioning"]["count"] > 0
    for rank, result in enumerate(errors):
        _assert_replicated(result["replicated"], rank)
        assert result["replicated"]["same_identity"] is True, rank  # parameter and probe digests as when sharded
    assert replicated["losses"] == pytest.approx(std["losses"][3:], abs=1e-6)  # resumed across reference layouts
    assert _max_diff(replicated["params"], std["params"]) <= 1e-6


def test_replicated_reference_is_loaded_whole_from_the_snapshot_while_the_policy_is_partitioned(zero3):
    _, errors = zero3
    for rank, result in enumerate(errors):
        replicated = result["pinned"]["replicated"]
        assert replicated["loaded_partitioned"] is True, rank  # the policy under the run's zero.Init
        _assert_replicated(replicated, rank)
        assert replicated["losses"][0] == pytest.approx(math.log(2), abs=1e-6), rank


def test_precompute_with_a_replicated_reference_matches_and_shares_the_sharded_cache_key(zero3):
    results, _ = zero3
    pre, pre_replicated = results["pre"], results["pre_replicated"]
    assert pre_replicated["builds"] == 1 and pre_replicated["backend"] == "PrecomputedReference"
    assert pre_replicated["cache_files"] == pre["cache_files"]  # the key does not depend on the reference's layout
    assert pre_replicated["losses"] == pytest.approx(results["std"]["losses"], abs=1e-6)
