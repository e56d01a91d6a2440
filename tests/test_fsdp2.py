"""FSDP2 (``fully_shard`` through Accelerate) with 2 real processes on the CPU (gloo), not mocked.

One launch (``accelerate launch`` with the shipped ``accelerate_configs/fsdp2.yaml`` in its CPU form) runs every
2-process phase (see tests/fsdp_worker.py); the single-process DP=1 runs without FSDP run here, on the same global
batch. Single-process checks of the FSDP2 pieces (configs, refusals, the in-forward head) are at the end.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch
import yaml

from pair_dpo_trainer.integrity import parameter_digest
from tests.fsdp_worker import CLIP, losses, tiny_tied_llama
from tests.launch import accelerate_launch
from tests.models import tiny_lora_llama
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[1]


def cpu_form(config: Path, out: Path) -> Path:
    """The shipped GPU config for 2 CPU processes: only device, process count, precision and address change."""
    data = yaml.safe_load(config.read_text())
    data.update(use_cpu=True, num_processes=2, mixed_precision="no", main_process_ip="127.0.0.1")
    data["main_process_port"] = free_port()
    path = out / config.name
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    """Runs tests/fsdp_worker.py once on 2 ranks; returns (rank-0 results, per-rank results)."""
    root = tmp_path_factory.mktemp("fsdp2")
    config = cpu_form(ROOT / "accelerate_configs" / "fsdp2.yaml", root)
    out = root / "out"
    out.mkdir()
    start = time.monotonic()
    accelerate_launch(config, "fsdp_worker.py", out, timeout=900)
    results = torch.load(out / "results.pt", weights_only=False)
    results["timings"]["launch"] = round(time.monotonic() - start, 1)
    print(f"\nFSDP2 launch timings (s): {results['timings']}")
    per_rank = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    return results, per_rank, out


@pytest.fixture(scope="module")
def dp1(tmp_path_factory):
    """The same runs in one process without FSDP (DP=1 x GA=2, same global batch), with first-step gradients."""
    from tests.fsdp_worker import trained

    root = tmp_path_factory.mktemp("dp1")
    models = {"std": None, "free": None, "tied": tiny_tied_llama(0), "peft": tiny_lora_llama(0), "clip": None}
    runs = {}
    for name, model in models.items():
        options = {"free": {"reference_free": True}, "clip": CLIP}.get(name, {})
        trainer, grads = trained(root / name, world_size=1, model=model, **options)
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
        runs[name] = {"losses": losses(trainer), "grads": grads, "params": params, "grad_norms": norms}
    return runs


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b) and len(a) > 0
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def _assert_sharded(held: dict, *, frozen: bool) -> None:
    """Every parameter a DTensor holding a strict slice on this rank (about half of the elements)."""
    assert held["count"] > 0 and held["dtensor"] == held["sliced"] == held["count"], held
    assert held["local_numel"] < 0.6 * held["numel"], held
    assert held["frozen"] == (held["count"] if frozen else 0), held


@pytest.mark.parametrize("mode", ["std", "free", "tied"])
@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_dp2_matches_dp1_without_fsdp_losses_and_gradients(fsdp2, dp1, mode):
    results, _, _ = fsdp2
    run, base = results[mode], dp1[mode]
    assert len(run["losses"]) == len(base["losses"]) == 6
    assert run["losses"][0] == pytest.approx(math.log(2), abs=1e-6) or mode == "free"
    assert run["losses"] == pytest.approx(base["losses"], abs=1e-5)
    scale = max(float(g.abs().max()) for g in base["grads"].values())
    assert scale > 0 and _max_diff(run["grads"], base["grads"]) / scale < 1e-5
    if mode == "std":  # Adam divides by sqrt(v): 1e-7 reduction-order noise in tiny gradients grows to ~2e-5
        assert _max_diff(run["params"], base["params"]) < 1e-4


@pytest.mark.distributed
@pytest.mark.slow
def test_policy_and_reference_are_sharded_dtensors_and_the_reference_is_frozen_and_unchanged(fsdp2):
    results, per_rank, _ = fsdp2
    std = results["std"]
    _assert_sharded(std["policy"], frozen=False)
    assert std["policy"]["wrapper"].startswith("FSDP")  # accelerate's fully_shard class, not DDP
    for rank, result in enumerate(per_rank):
        _assert_sharded(result["reference"]["std"], frozen=True)
        assert result["reference"]["std"]["grads"] == 0, rank  # inference-only: no gradient ever
    assert std["reference_training"] is False
    before, after = std["reference_digest"]
    assert before == after and before is not None


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_training_arguments_shard_the_policy_instead_of_training_ddp(fsdp2):
    """``fsdp="full_shard"`` + ``fsdp_config={"fsdp_version": 2}`` on two CPU processes would train as plain DDP
    (Accelerate drops its FSDP plugin on the CPU) and exit 0: every parameter must be a DTensor holding a slice."""
    results, _, _ = fsdp2
    run = results["args_fsdp"]
    _assert_sharded(run["policy"], frozen=False)
    _assert_sharded(run["reference"], frozen=True)
    assert run["losses"] == pytest.approx(results["std"]["losses"][:2], abs=1e-6)


@pytest.mark.distributed
@pytest.mark.slow
def test_lora_policy_under_fsdp2_matches_dp1(fsdp2, dp1):
    """A PEFT policy: Accelerate shards the LoRA-wrapped model; the reference is the same model, adapters disabled."""
    results, _, _ = fsdp2
    run = results["peft"]
    assert run["policy"]["dtensor"] == run["policy"]["count"] > 0
    assert 0 < run["policy"]["frozen"] < run["policy"]["count"]  # frozen base, trainable adapters
    assert run["losses"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert run["losses"] == pytest.approx(dp1["peft"]["losses"], abs=1e-5)
    scale = max(float(g.abs().max()) for g in dp1["peft"]["grads"].values())
    assert _max_diff(run["grads"], dp1["peft"]["grads"]) / scale < 1e-5


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_and_trainer_activation_checkpointing_train_exactly_like_no_checkpointing(fsdp2):
    results, _, _ = fsdp2
    for name in ("ac", "gc"):
        assert results[name]["losses"] == pytest.approx(results["std"]["losses"], abs=1e-6), name
        assert _max_diff(results[name]["grads"], results["std"]["grads"]) < 1e-6, name


@pytest.mark.distributed
@pytest.mark.slow
def test_sharded_checkpoints_resume_exactly_and_the_final_save_writes_full_weights(fsdp2):
    results, _, out = fsdp2
    std = results["std"]
    assert "SHARDED_STATE_DICT" in std["plugin_state_dict_type"]  # from the shipped fsdp2.yaml
    assert {"pytorch_model_fsdp_0", "optimizer_0", "pair_dpo_reference.json"} <= set(std["checkpoint_files"])
    resumed = results["resume"]
    assert resumed["losses"] == pytest.approx(std["losses"][3:], abs=1e-6)
    assert parameter_digest(resumed["params"].items()) == parameter_digest(std["params"].items())
    assert "model.safetensors" in std["final_files"]
    from safetensors.torch import load_file

    final = load_file(out / "std" / "final" / "model.safetensors")
    assert set(final) == set(std["params"]) and _max_diff(final, std["params"]) == 0.0


@pytest.mark.distributed
@pytest.mark.slow
def test_full_state_dict_checkpoints_resume_exactly(fsdp2):
    run = fsdp2[0]["full_state"]
    assert "pytorch_model_fsdp.bin" in run["checkpoint_files"] and "model.safetensors" in run["checkpoint_files"]
    assert len(run["losses"]) == 2 and run["resumed_losses"] == pytest.approx(run["losses"], abs=1e-6)
    assert parameter_digest(run["resumed_params"].items()) == parameter_digest(run["params"].items())


@pytest.mark.distributed
@pytest.mark.slow
def test_replicated_reference_equals_the_sharded_one_and_resumes_its_checkpoint(fsdp2):
    results, per_rank, _ = fsdp2
    replicated, std = results["replicated"], results["std"]
    for rank, result in enumerate(per_rank):
        held = result["reference"]["replicated"]
        assert held["dtensor"] == 0 and held["frozen"] == held["count"] > 0, (rank, held)
        assert held["local_numel"] == held["numel"] == result["reference"]["std"]["numel"], (rank, held)
        assert result["reference_logps"]["replicated"] == pytest.approx(result["reference_logps"]["std"], abs=1e-6)
    assert replicated["identity"]["param_digest"] == std["identity"]["param_digest"]
    assert replicated["identity"]["probe_digest"] == std["identity"]["probe_digest"]
    assert replicated["losses"] == pytest.approx(std["losses"][3:], abs=1e-6)
    assert _max_diff(replicated["params"], std["params"]) <= 1e-6


@pytest.mark.distributed
@pytest.mark.slow
def test_precomputed_reference_under_fsdp2_matches_online_and_its_cache_is_reused(fsdp2):
    results, _, _ = fsdp2
    pre, std = results["pre"], results["std"]
    assert pre["losses"] == pytest.approx(std["losses"], abs=1e-6)
    assert pre["builds"] == 1 and pre["backend"] == "PrecomputedReference" and len(pre["cache_files"]) == 1
    assert results["pre_resume"]["builds"] == 0  # the resume read the cache: the reference was never built
    assert results["pre_resume"]["losses"] == pytest.approx(std["losses"][3:], abs=1e-6)


@pytest.mark.distributed
@pytest.mark.slow
def test_regional_compile_under_fsdp2_compiles_both_models_and_matches_eager(fsdp2):
    """torch_compile=True compiles the decoder layers in place before fully_shard (policy and reference) and trains
    the same steps as eager (a block-mask SDPA kernel stands in for CUDA varlen: equal to sdpa_segments to ~1e-7)."""
    results = fsdp2[0]
    run = results["compile"]
    assert run["policy_compiled"] and run["reference_compiled"]
    _assert_sharded(run["reference"], frozen=True)
    assert len(run["compiled"]) == 2 and run["compiled"] == pytest.approx(results["std"]["losses"][:2], abs=1e-5)


@pytest.mark.parametrize(
    ("phase", "code", "words"),
    [
        ("tamper", "reference_changed", "parameter digest"),
        ("fsdp1", "fsdp1_unsupported", "fsdp_version"),
        ("eval_first", "unsupported_combination", "evaluate() before train()"),
        ("peft_pre", "unsupported_combination", "PEFT policy under FSDP2"),
    ],
)
@pytest.mark.distributed
@pytest.mark.slow
def test_a_changed_reference_fsdp1_and_evaluate_first_are_refused_on_every_rank(fsdp2, phase, code, words):
    _, per_rank, _ = fsdp2
    for rank, result in enumerate(per_rank):
        assert result[phase]["reason_code"] == code, (rank, result[phase])
        assert words in result[phase]["message"], (rank, result[phase])
        assert result[phase]["step"] in (None, 0)  # nothing restored, no step ran


@pytest.mark.distributed
@pytest.mark.slow
def test_pinned_snapshot_under_fsdp2_is_verified_and_a_changed_one_is_refused_on_resume(fsdp2):
    _, per_rank, _ = fsdp2
    for rank, result in enumerate(per_rank):
        pinned = result["pinned"]
        assert pinned["identity"]["pinned"] is True and pinned["identity"]["manifest_digest"], rank
        assert pinned["losses"][0] == pytest.approx(math.log(2), abs=1e-6)
        _assert_sharded(pinned["reference"], frozen=True)
        assert pinned["tamper"]["reason_code"] == "reference_changed", (rank, pinned["tamper"])
        assert "manifest" in pinned["tamper"]["message"] and pinned["tamper"]["step"] == 0


# ---------------------------------------------------------------------------------------------- single process
FSDP2_CONFIGS = ("fsdp2.yaml", "fsdp2_offload.yaml", "fsdp2_multinode.yaml")


def _launch_env(config: Path) -> dict[str, str]:
    """The environment ``accelerate launch --config_file config`` gives the training processes (no launch)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config), "train.py"])
    args, _, _ = _validate_launch_command(args)
    assert args.use_fsdp and not args.cpu
    return prepare_multi_gpu_env(args)


@pytest.mark.parametrize("name", FSDP2_CONFIGS)
def test_shipped_fsdp2_configs_parse_with_accelerate_into_a_supported_fsdp2_plugin(name, monkeypatch, tmp_path):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy, StateDictType

    from pair_dpo_trainer.config.sections import FsdpOptions
    from pair_dpo_trainer.parallel.fsdp2 import fsdp2_problems, requested_fsdp_version
    from tests.dpo_fixtures import cpu_config

    env = _launch_env(ROOT / "accelerate_configs" / name)
    for key, value in env.items():
        if key.startswith(("FSDP_", "ACCELERATE_USE_FSDP")):
            monkeypatch.setenv(key, value)
    args = FsdpOptions.from_config(cpu_config(tmp_path))
    assert requested_fsdp_version(args) == 2
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT and not plugin.cpu_ram_efficient_loading
    offload = name == "fsdp2_offload.yaml"
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) == offload
    assert plugin.activation_checkpointing == offload
    assert fsdp2_problems(plugin, args) == []
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"


def test_the_multinode_config_names_every_placeholder_it_asks_to_fill():
    data = yaml.safe_load((ROOT / "accelerate_configs" / "fsdp2_multinode.yaml").read_text())
    assert data["num_machines"] > 1 and data["num_processes"] % data["num_machines"] == 0
    assert data["rdzv_backend"] == "static" and data["main_process_ip"] and data["main_process_port"]  # accelerate's


def _plugin(monkeypatch, **kwargs):
    """An FSDP2 plugin; its constructor writes ``FSDP_CPU_RAM_EFFICIENT_LOADING`` to the environment: undone after."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")
    return FullyShardedDataParallelPlugin(fsdp_version=2, **kwargs)


@pytest.mark.parametrize(
    ("plugin_kwargs", "config_kwargs", "words"),
    [
        ({"cpu_ram_efficient_loading": True}, {}, "cpu_ram_efficient_loading"),
        ({"activation_checkpointing": True}, {"gradient_checkpointing": True}, "recompute"),
        ({"activation_checkpointing": True}, {"torch_compile": True}, "gradient_checkpointing=True"),
        ({"state_dict_type": "SHARDED_STATE_DICT"}, {"save_only_model": True}, "save_only_model"),
    ],
)
def test_unsupported_fsdp2_settings_are_refused_with_a_reason(
    tmp_path, monkeypatch, plugin_kwargs, config_kwargs, words
):
    from pair_dpo_trainer.config.sections import FsdpOptions
    from pair_dpo_trainer.parallel.fsdp2 import fsdp2_problems
    from tests.dpo_fixtures import cpu_config

    fsdp = FsdpOptions.from_config(cpu_config(tmp_path, **config_kwargs))
    problems = fsdp2_problems(_plugin(monkeypatch, **plugin_kwargs), fsdp)
    assert [code for code, _ in problems] == ["unsupported_combination"] and words in problems[0][1]


def test_fsdp1_is_refused_from_training_arguments_and_from_the_launcher_environment(tmp_path, monkeypatch):
    from pair_dpo_trainer.config.sections import FsdpOptions
    from pair_dpo_trainer.errors import ConfigError
    from pair_dpo_trainer.parallel.fsdp2 import check_fsdp_version, fsdp2_problems
    from tests.dpo_fixtures import cpu_config

    args = cpu_config(tmp_path)
    check_fsdp_version(FsdpOptions.from_config(args))  # no FSDP asked for: nothing to refuse
    args.fsdp_plugin_args = {"fsdp_version": 1}
    with pytest.raises(ConfigError) as error:
        check_fsdp_version(FsdpOptions.from_config(args))
    assert error.value.reason_code == "fsdp1_unsupported" and "fsdp_version': 2" in str(error.value)
    args.fsdp_plugin_args = None
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ConfigError, match="fsdp1_unsupported"):
        check_fsdp_version(FsdpOptions.from_config(args))
    stub = type("Plugin", (), {"fsdp_version": 1})()  # an FSDP1 plugin (it cannot be built on a CPU-only machine)
    assert [code for code, _ in fsdp2_problems(stub, FsdpOptions.from_config(args))] == ["fsdp1_unsupported"]


def test_setup_fsdp2_installs_the_plugin_where_accelerate_dropped_it_and_clears_the_output_cast(tmp_path, monkeypatch):
    """Accelerate's bf16 policy casts every FSDP unit's output to bf16, the head's float32 log-probs included."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    from pair_dpo_trainer.config.sections import FsdpOptions
    from pair_dpo_trainer.parallel import fsdp2

    args = FsdpOptions(plugin_args={"fsdp_version": 2, "reshard_after_forward": True})
    state = type("State", (), {"distributed_type": DistributedType.MULTI_CPU, "mixed_precision": "bf16"})()
    accelerator = type("Accelerator", (), {"state": state, "device": torch.device("cpu")})()
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")  # the plugin's constructor writes it
    previous = PartialState().distributed_type
    try:
        plugin = fsdp2.setup_fsdp2(accelerator, args)
        assert PartialState().distributed_type == DistributedType.FSDP  # AcceleratorState() copies it back
    finally:
        PartialState().distributed_type = previous
    assert state.distributed_type == DistributedType.FSDP and state.fsdp_plugin is plugin
    policy = plugin.mixed_precision_policy
    assert policy.param_dtype == policy.reduce_dtype == torch.bfloat16 and policy.output_dtype is None
    assert fsdp2.compute_dtype(plugin) == torch.bfloat16 and not fsdp2.offloads_params(plugin)


def test_without_fsdp_nothing_is_set_up_and_ref_fsdp_shard_is_refused(tmp_path):
    from pair_dpo_trainer import PairDPOTrainer
    from pair_dpo_trainer.errors import ConfigError
    from tests.dpo_fixtures import cpu_config, synthetic_pairs
    from tests.models import tiny_llama, tiny_tokenizer

    pairs, tokenizer = synthetic_pairs(8), tiny_tokenizer()
    trainer = PairDPOTrainer(tiny_llama(), cpu_config(tmp_path), train_dataset=pairs, processing_class=tokenizer)
    assert trainer.fsdp_plugin is None and not trainer.is_fsdp_enabled
    with pytest.raises(ConfigError) as error:
        args = cpu_config(tmp_path, ref_fsdp_shard=True)
        PairDPOTrainer(tiny_llama(), args, train_dataset=pairs, processing_class=tokenizer)
    assert error.value.reason_code == "unsupported_combination" and "ref_fsdp_shard" in str(error.value)


@pytest.mark.parametrize(
    ("options", "code"),
    [({"ref_fsdp_shard": "yes"}, "bad_ref_fsdp_shard"), ({"ref_fsdp_shard": False, "ref_offload_params": True}, None)],
)
def test_ref_fsdp_shard_values_are_validated_with_the_config(tmp_path, options, code):
    from pair_dpo_trainer.errors import ConfigError
    from tests.dpo_fixtures import cpu_config

    with pytest.raises(ConfigError) as error:
        cpu_config(tmp_path, **options)
    assert error.value.reason_code == (code or "unsupported_combination")


def test_the_in_forward_head_computes_the_same_logps_and_gradients_as_the_hooked_head():
    """The FSDP2 path (chunked log-probs inside the model's own head call) against the default path, unsharded."""
    from pair_dpo_trainer.collators import PackedPairCollator
    from pair_dpo_trainer.modeling.attention import enable_pair_varlen
    from pair_dpo_trainer.modeling.logprobs import (
        _sequence_sums,
        check_supported_head,
        in_forward_token_logps,
        packed_sequence_logps,
    )
    from tests.dpo_fixtures import random_features
    from tests.models import tiny_llama

    batch = PackedPairCollator()(random_features(3, 4, vocab=64, prompt_len=(2, 9), completion_len=(1, 8)))
    results = []
    for in_forward in (False, True):
        model = tiny_llama(0)
        enable_pair_varlen(model, "sdpa_segments")
        if in_forward:
            positions = batch.completion_positions
            targets = batch.labels.reshape(-1).index_select(0, positions)
            tokens = in_forward_token_logps(model, check_supported_head(model), batch, targets, chunk_size=5)
            index = batch.sequence_index.reshape(-1).index_select(0, positions)
            logps = _sequence_sums(tokens, index, batch.num_sequences)  # the sum both paths use
        else:
            logps = packed_sequence_logps(model, batch, chunk_size=5)
        logps.pow(2).sum().backward()
        results.append((logps.detach(), {n: p.grad for n, p in model.named_parameters()}))
        assert model.lm_head.forward.__func__ is type(model.lm_head).forward  # the instance override is gone
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert got.dtype == torch.float32 and set(got_grads) == set(want_grads)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_identity_names_do_not_depend_on_activation_checkpointing_wrappers():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from pair_dpo_trainer.parallel.gather import gathered_named_parameters
    from tests.models import tiny_llama

    plain, wrapped = tiny_llama(0), tiny_llama(0)
    for index, layer in enumerate(wrapped.model.layers):
        wrapped.model.layers[index] = checkpoint_wrapper(layer)
    assert any("_checkpoint_wrapped_module" in name for name, _ in wrapped.named_parameters())
    digests = [parameter_digest(gathered_named_parameters(model)) for model in (plain, wrapped)]
    assert digests[0] == digests[1]


def test_the_run_summary_names_fsdp2_and_the_reference_layout(tmp_path):
    from pair_dpo_trainer.observability.summary import run_summary
    from tests.dpo_fixtures import cpu_config

    line = run_summary(cpu_config(tmp_path), attn_backend="sdpa_segments", source=None, fsdp2=True)
    assert line.endswith("| FSDP2, reference sharded")
    args = cpu_config(tmp_path, ref_fsdp_shard=False)
    assert "FSDP2, reference replicated (ref_fsdp_shard=False)" in run_summary(
        args, attn_backend="x", source=None, fsdp2=True
    )
    assert "FSDP2" not in run_summary(args, attn_backend="x", source=None)


@pytest.mark.distributed
@pytest.mark.slow
def test_gradient_clipping_under_fsdp2_uses_the_global_norm_of_dp1(fsdp2, dp1):
    run, base = fsdp2[0]["clip"], dp1["clip"]
    assert min(base["grad_norms"]) > CLIP["max_grad_norm"]  # the clip is active in every step
    assert run["grad_norms"] == pytest.approx(base["grad_norms"], rel=1e-5)
    assert run["losses"] == pytest.approx(base["losses"], abs=1e-6)
    assert _max_diff(run["params"], base["params"]) < 1e-4  # Adam-amplified reduction-order noise, as for std


@pytest.mark.distributed
@pytest.mark.slow
def test_bf16_mixed_precision_keeps_float32_logps_and_a_reference_equal_to_the_policy_at_step_0(fsdp2):
    """Accelerate's bf16 policy would cast the head's float32 log-probs to bf16 (output_dtype, cleared); a reference
    cast with ``.to(bf16)`` would round the rotary buffer and differ from the policy at step 0 (loss != ln 2)."""
    run = fsdp2[0]["bf16"]
    assert run["param_dtype"] == "torch.bfloat16" and run["output_dtype"] == "None"
    assert run["policy_logps_dtype"] == "torch.float32"
    assert run["reference_param_dtypes"] == ["torch.bfloat16"] and "torch.float32" in run["reference_buffer_dtypes"]
    assert run["losses"][0] == pytest.approx(math.log(2), abs=1e-6)
