"""CPU smoke test of ``benchmarks.dpo`` (tiny model, fp32, 1 pair, 2 warmup + 1 timed step, ceiling, profile) and of
the TRL side's workload and row (``benchmarks.trl_dpo``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from benchmarks import cudagraph_probe, profile_summary, report, trl_dpo, workload
from pair_dpo_trainer.collators import PackedPairCollator
from pair_dpo_trainer.testing.cpu_varlen import install_traceable_varlen

# The fields of the former trl_dpo_baseline.py's RESULT row: ours and benchmarks.trl_dpo must carry every one of them.
TRL_RESULT_FIELDS = (
    "tag rank world attn padding_free_requested padding_free_effective deepspeed bs_pairs steps_timed step_median_s "
    "step_mean_s step_min_s step_max_s real_tokens_per_step padded_tokens_per_step padding_frac real_tok_s_gpu "
    "real_tok_s_gpu_from_median mfu8N_989 mfu8N_790 n_params n_params_no_embed peak_alloc_gib peak_reserved_gib "
    "train_wall_s shapes_first no_cudnn_sdp step_s seq_len warmup_step_s"
).split()

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    from benchmarks import dpo

    return dpo


def _trl_make_dataset_rows(n: int, seed: int, vocab: int = 32000) -> dict[str, list]:
    """A frozen copy of trl_dpo_baseline.make_dataset's drawing (without the datasets.Dataset wrapper)."""
    rng = np.random.default_rng(seed)
    rows = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": []}
    for _ in range(n):
        lp = int(rng.integers(32, 513))
        lc, lr = (int(np.clip(round(rng.lognormal(math.log(200), 0.9)), 16, 1024)) for _ in range(2))
        rows["prompt_ids"].append(rng.integers(3, vocab, lp).tolist())
        rows["chosen_ids"].append(rng.integers(3, vocab, lc - 1).tolist() + [1])
        rows["rejected_ids"].append(rng.integers(3, vocab, lr - 1).tolist() + [1])
    return rows


def test_pairs_match_the_trl_baseline_workload(bench):
    ours = bench.make_pairs(50, seed=0)
    trl = _trl_make_dataset_rows(50, seed=0)
    assert [r["prompt_input_ids"] for r in ours] == trl["prompt_ids"]
    assert [r["chosen_input_ids"] for r in ours] == trl["chosen_ids"]
    assert [r["rejected_input_ids"] for r in ours] == trl["rejected_ids"]


@pytest.mark.integration
def test_bs_for_tokens_picks_pairs_per_microbatch(bench):
    args = bench.parse_args(["--bs-for-tokens", "16384"])
    bs = bench.pairs_per_microbatch(args)
    assert 10 <= bs <= 20  # mean pair cost of the workload is ~1.1k tokens


@pytest.mark.integration
def test_tiny_cpu_run_prints_result_ceiling_and_profile(bench, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    row = bench.main(
        ["--tiny", "--bs", "1", "--steps", "1", "--warmup", "2", "--ceiling", "--profile", "--tag", "smoke"]
    )
    out = capsys.readouterr().out
    assert "world_size 1" in out
    assert all(field in row for field in TRL_RESULT_FIELDS)
    assert row["impl"] == "pair_dpo" and row["steps_timed"] == 1 and row["padding_frac"] == 0.0
    assert row["real_tok_s_gpu"] > 0 and row["ours_over_ceiling"] > 0
    # the prompt packed once (the default on the tiny Llama): TRL's count of the same steps is larger, MFU uses ours
    assert row["share_prompt"] is True and 0 < row["prompt_tokens_saved_frac"] < 0.5
    assert row["trl_tokens_per_step"] > row["real_tokens_per_step"]
    assert row["trl_tok_s_gpu"] / row["real_tok_s_gpu"] == pytest.approx(
        row["trl_tokens_per_step"] / row["real_tokens_per_step"], rel=1e-3
    )
    lines = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [line["impl"] for line in lines] == ["pair_dpo_ceiling", "pair_dpo"]
    assert any(line.startswith("RESULT {") for line in out.splitlines())
    assert any(line.startswith("CEILING {") for line in out.splitlines())
    summary = (tmp_path / "profile_summary.txt").read_text()
    assert "Sync candidates inside the micro-batch loop" in summary
    assert "bench::microbatch" in summary and "Top-15 ops" in summary


def test_trl_side_draws_the_same_pairs_and_builds_the_model_size_dims():
    """The TRL side (benchmarks.trl_dpo, which replaced running the outside script with a patched LlamaConfig) draws
    the frozen TRL workload and builds the ``--model-size`` dimensions."""
    assert workload.trl_rows(50, seed=0) == _trl_make_dataset_rows(50, seed=0)
    args = trl_dpo.parse_args(["--model-size", "1.5b", "--tag", "trl_1p5b", "--attn", "sdpa"])
    dims = workload.model_dims(args.model_size)
    assert (dims["hidden_size"], dims["intermediate_size"], dims["num_hidden_layers"], dims["vocab_size"]) == (
        2048, 5632, 24, 152064,
    )  # fmt: skip
    assert workload.model_dims("254m") == dict(  # the former baseline's LlamaConfig, exactly
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
        vocab_size=32000, max_position_embeddings=4096,
    )  # fmt: skip
    assert trl_dpo.parse_args(["--tiny"]).model_size == "tiny"


def test_trl_row_carries_every_baseline_field():
    args = trl_dpo.parse_args(["--tag", "t", "--steps", "2", "--warmup", "1"])
    ctx = {"rank": 0, "world": 1, "cuda": False, "n_params": 100, "n_embed": 10, "train_wall_s": 1.0}
    ends = [0.0, 2.0, 3.0]  # warmup + steps step ends: the timed steps take 2 s and 1 s
    log = [(6, 8, (2, 4))] * 3
    trainer = type("T", (), {"is_deepspeed_enabled": False, "padding_free": False})()
    row = trl_dpo.result_row(args, ctx, ends, log, trainer)
    assert all(field in row for field in TRL_RESULT_FIELDS) and row["impl"] == "trl"
    assert row["step_s"] == [2.0, 1.0] and row["real_tok_s_gpu"] == 4.0 and row["padding_frac"] == 0.25


def test_trl_side_without_trl_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setattr(trl_dpo, "trl_available", lambda: False)
    assert trl_dpo.main(["--tiny", "--tag", "x"]) == trl_dpo.TRL_MISSING
    assert "pip install 'trl==1.16.0'" in capsys.readouterr().out


@pytest.fixture
def dynamo_reset():
    import torch

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.slow  # compiles the tiny model and runs both ceilings (~15-20 s)
def test_tiny_cpu_compile_run_has_compile_fields_shape_ceiling_and_host_breakdown(
    bench, tmp_path, monkeypatch, capsys, dynamo_reset
):
    """``--compile`` (aot_eager; a traceable CPU stand-in for the torch_varlen kernel), both ceilings, profile."""
    monkeypatch.setenv("OUT", str(tmp_path))
    backend = install_traceable_varlen(monkeypatch)  # torch_compile refuses sdpa_segments (host-side segment bounds)
    argv = ["--tiny", "--bs", "1", "--steps", "1", "--warmup", "2", "--tag", "smoke_c", "--profile"]
    argv += ["--attn-backend", backend]
    argv += ["--compile", "--compile-backend", "aot_eager", "--ceiling", "--ceiling-shape", "2x16"]
    row = bench.main(argv)
    out = capsys.readouterr().out
    lines = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [line["impl"] for line in lines] == ["pair_dpo_ceiling", "pair_dpo_ceiling_shape", "pair_dpo"]
    assert all(line["compile"] is True and line["compile_backend"] == "aot_eager" for line in lines)
    assert all(line["dynamo_graphs_timed"] >= 0 for line in lines)
    assert row["dynamo_graphs_warmup"] > 0  # the trainer compiled in its untimed first steps
    ceiling, shaped = lines[0], lines[1]
    assert ceiling["layers_compiled_here"] == 0  # the trainer had compiled policy and reference already
    assert shaped["tag"] == "smoke_c_ceiling2x16" and shaped["ceiling_shape"] == "2x16"
    assert shaped["docs_per_step"] == 2 and shaped["doc_len"] == 16 and shaped["real_tokens_per_step"] == 32
    assert shaped["steps_timed"] == 1 and shaped["real_tok_s_gpu"] > 0
    assert row["ours_over_ceiling_shape"] == shaped["ours_over_ceiling_shape"] > 0
    assert row["ceiling_shape_real_tok_s_gpu"] == shaped["real_tok_s_gpu"]
    assert "RATIO ours/ceiling2x16 = " in out
    host = row["profile_host_ms"]
    for region in ("pair_dpo::policy_logps", "pair_dpo::reference_logps", "pair_dpo::loss", "backward (derived)"):
        assert host[region] > 0
    assert "bench::optimizer.step" in host and "other/unattributed" in host
    assert row["profile_step_ms"] == host["bench::step"] > 0 and row["profile_gpu_busy_ms"] is None
    summary = (tmp_path / "profile_summary.txt").read_text()
    assert 0 < row["profile_tokens"] and f", {row['profile_tokens']} real tokens)" in summary.splitlines()[0]
    assert "Sync candidates inside the micro-batch loop" in summary  # the sync table is still there
    assert "Host wall time per step by region" in summary and "Device time per step: n/a" in summary


def test_shape_batches_pack_docs_of_exactly_len_tokens_with_every_non_first_token_scored(bench):
    trainer = type("T", (), {"data_collator": PackedPairCollator(), "args": type("A", (), {"device": "cpu"})()})()
    ((batch,),) = bench.shape_batches(trainer, 4, 16, 1, seed=0)
    assert batch.cu_seqlens.tolist() == [0, 16, 32, 48, 64] and batch.num_tokens == 64
    assert int(batch.completion_mask.sum()) == 4 * 15
    assert batch.completion_mask.reshape(4, 16)[:, -1].sum() == 0  # a document's last token has no target


def test_parse_shape(bench):
    assert bench.parse_shape("16x1024") == (16, 1024)
    for bad in ("3x8", "16-1024", "0x8", "2x1"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_shape(bad)


class _Event:
    def __init__(self, name, start, end, device=False, annotation=False):
        self.name = name
        self.time_range = type("R", (), {"start": start, "end": end})()
        self.device_type = "DeviceType.CUDA" if device else "DeviceType.CPU"
        self.is_user_annotation = annotation
        self.is_python_function = False


def test_host_breakdown_regions_backward_other_and_gpu_busy():
    events = [
        _Event("bench::step", 0, 100),
        _Event("bench::microbatch", 5, 60),
        _Event("pair_dpo::policy_logps", 10, 20),
        _Event("pair_dpo::reference_logps", 20, 30),
        _Event("pair_dpo::loss", 30, 32),
        _Event("bench::optimizer.step", 70, 80),
        _Event("bench::after_optimizer", 80, 100),
        _Event("kernel_a", 0, 5, device=True),
        _Event("kernel_b", 3, 8, device=True),
        _Event("kernel_c", 50, 60, device=True),
        _Event("pair_dpo::loss", 30, 40, device=True, annotation=True),  # device-side annotation: not a kernel
    ]
    result = profile_summary.host_breakdown(events)
    ms = {row["region"]: row["host_ms"] * 1e3 for row in result["rows"]}  # back to us
    assert ms["backward (derived)"] == pytest.approx(28)  # 32 -> 60
    assert ms["other/unattributed"] == pytest.approx(20)  # 100 - (22 + 28 + 10 + 20)
    assert ms["bench::step"] == pytest.approx(100) and ms["bench::microbatch"] == pytest.approx(55)
    assert result["kernel_ms"] * 1e3 == pytest.approx(20) and result["busy_ms"] * 1e3 == pytest.approx(18)
    text = "\n".join(profile_summary.format_breakdown(result, use_device=True))
    assert "launch/host-bound" in text and "GPU busy (union) 0.018 ms" in text


def test_idle_gaps_charge_each_device_gap_to_the_host_region_and_op_running_meanwhile():
    events = [
        _Event("bench::step", 0, 1000),
        _Event("bench::microbatch", 0, 800),
        _Event("pair_dpo::policy_logps", 0, 300),
        _Event("aten::mm", 120, 290),  # the host op during the first gap
        _Event("pair_dpo::loss", 300, 310),
        _Event("autograd::engine::evaluate_function: MmBackward0", 400, 700),
        _Event("hf::clip_grad_norm", 800, 1000),
        _Event("kernel_a", 0, 100, device=True),
        _Event("kernel_b", 90, 110, device=True),  # overlaps a: one busy interval 0-110
        _Event("kernel_c", 300, 350, device=True),  # gap 110-300 (190 us) under policy_logps / aten::mm
        _Event("kernel_d", 400, 450, device=True),  # gap 350-400 (50 us): launch spacing, not counted
        _Event("kernel_e", 800, 950, device=True),  # gap 450-800 (350 us) in backward; then 950-1000 (50 us)
    ]
    gaps = profile_summary.idle_gaps(events)
    assert gaps["gaps"] == 2 and gaps["idle_ms"] * 1e3 == pytest.approx(540)
    by_region = {r: ms * 1e3 for r, ms in gaps["by_region"].items()}
    assert by_region == pytest.approx({"backward (derived)": 350, "pair_dpo::policy_logps": 190})
    first, second = gaps["longest"]
    assert first["ms"] * 1e3 == pytest.approx(350) and first["op"].startswith("autograd::engine")
    assert second["ms"] * 1e3 == pytest.approx(190) and second["op"] == "aten::mm"
    text = "\n".join(profile_summary.format_gaps(gaps))
    assert "per step: 2, 0.540 ms" in text and "aten::mm" in text
    assert profile_summary.idle_gaps([_Event("kernel", 0, 5, device=True)])["gaps"] == 0  # no step range


def test_bench_report_per_gpu_ratio_averages_ranks(tmp_path):
    rows = [
        {"tag": "z3", "impl": "pair_dpo", "rank": 0, "real_tok_s_gpu": 10.0},
        {"tag": "z3", "impl": "pair_dpo", "rank": 1, "real_tok_s_gpu": 30.0},
        {"tag": "z3", "impl": "pair_dpo_ceiling", "rank": 0, "real_tok_s_gpu": 99.0},
        {"tag": "one", "real_tok_s_gpu": 40.0},  # a TRL row: no impl
    ]
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    loaded = report.load_rows(str(path), str(tmp_path / "missing.jsonl"))
    assert report.ratio_line(loaded, "z3", "one").startswith("RATIO z3/one = 0.500 per GPU (20 / 40 tok/s")
    assert "missing nope" in report.ratio_line(loaded, "z3:pair_dpo_ceiling", "nope")


# --------------------------------------------------------------------------------------------- token budget
TRL_FLAGS = {  # the former trl_dpo_baseline.py's argparse flags, frozen: benchmarks.trl_dpo still takes them all
    "--tag", "--attn", "--padding_free", "--bs", "--steps", "--warmup", "--max_length", "--workers", "--results",
    "--tiny", "--seed", "--no_cudnn_sdp",
}  # fmt: skip


@pytest.mark.integration
def test_budget_flags_and_heavy_mix(bench):
    args = bench.parse_args(["--mix", "heavy", "--bs", "32", "--max-tokens-per-microbatch", "16384", "--pad-to-budget"])
    config = bench.build_config(args, args.bs, 3, bf16=False)
    assert config.max_tokens_per_microbatch == 16384 and config.pad_to_budget and config.pairs_per_rank_per_step == 32
    assert config.max_length == 8192 and config.max_prompt_length == 4096
    costs = np.array([2 * len(r["prompt_input_ids"]) + len(r["chosen_input_ids"]) + len(r["rejected_input_ids"])
                      for r in bench.make_pairs(400, seed=0, mix="heavy")])  # fmt: skip
    assert costs.max() <= 16384 and costs.max() > 4 * np.median(costs)  # heavy-tailed, and within the budget
    assert bench.pairs_per_microbatch(bench.parse_args(["--bs-for-tokens", "16384"])) == bench.pairs_per_microbatch(
        bench.parse_args(["--bs-for-tokens", "16384", "--seed", "0"])
    )
    for flag, value in (("--share-prompt", True), ("--no-share-prompt", False)):
        assert bench.build_config(bench.parse_args([flag]), 1, 3, bf16=False).share_prompt is value
    assert bench.build_config(bench.parse_args([]), 1, 3, bf16=False).share_prompt is None  # the config's default
    for bad in (["--max-tokens-per-microbatch", "4096", "--ga", "2"], ["--pad-to-budget"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


@pytest.mark.integration
def test_tiny_cpu_budget_run_counts_microbatches_and_times_the_microbatch_ceiling(bench, tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    argv = ["--tiny", "--bs", "4", "--max-tokens-per-microbatch", "3072", "--pad-to-budget", "--steps", "1"]
    row = bench.main([*argv, "--warmup", "1", "--ceiling", "--tag", "smoke_budget"])
    assert row["max_tokens_per_microbatch"] == 3072 and row["pad_to_budget"] is True and row["grad_accum"] == 1
    assert row["microbatches_per_step_mean"] >= 2 and row["microbatch_tokens_max"] == 3072  # padded rows
    assert 0 < row["padding_frac"] < 1 and row["alloc_conf"] == "expandable_segments:True"
    ceiling = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()][0]
    assert ceiling["impl"] == "pair_dpo_ceiling" and ceiling["ceiling_rows"] == "microbatches"
    assert ceiling["real_tokens_per_step"] == row["real_tokens_per_step"]  # the same pairs, pad not counted
    assert ceiling["microbatches_per_step_mean"] == row["microbatches_per_step_mean"]  # planned by the same costs


def test_trl_side_takes_the_former_baseline_flags():
    argv = ["--tag", "a", "--attn", "sdpa", "--padding_free", "--bs", "2", "--steps", "3", "--warmup", "1"]
    argv += ["--max_length", "512", "--workers", "0", "--results", "r.jsonl", "--tiny", "--seed", "1", "--no_cudnn_sdp"]
    flags = {a for a in argv if a.startswith("--")}
    assert flags == TRL_FLAGS
    args = trl_dpo.parse_args(argv)
    assert (args.bs, args.steps, args.warmup, args.max_length, args.padding_free, args.no_cudnn_sdp) == (
        2, 3, 1, 512, True, True,
    )  # fmt: skip


def test_probe_rows_have_one_shape():
    rows = cudagraph_probe.rows(512, 5, vocab=100)
    assert {row.num_tokens for row in rows} == {512} and len({row.num_pairs for row in rows}) > 1


@pytest.mark.distributed
@pytest.mark.slow
def test_bench_dpo_runs_under_fsdp2_and_its_ref_fsdp_shard_flag_reaches_the_run(tmp_path):
    """``benchmarks.dpo --tiny --ref-fsdp-shard false`` through ``accelerate launch`` with the shipped FSDP2 config in
    its CPU form (2 gloo processes): the row says FSDP2 ran, with a replicated reference, in float32."""
    config = yaml.safe_load((ROOT / "accelerate_configs" / "fsdp2.yaml").read_text())
    config.update(use_cpu=True, num_processes=2, mixed_precision="no", main_process_ip="127.0.0.1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        config["main_process_port"] = sock.getsockname()[1]
    (tmp_path / "fsdp2.yaml").write_text(yaml.safe_dump(config))
    results = tmp_path / "bench.jsonl"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "fsdp2.yaml")]
    cmd += ["-m", "benchmarks.dpo", "--tiny", "--tag", "fsdp2", "--ref-fsdp-shard", "false", "--ceiling"]
    cmd += ["--results", str(results), "--bs", "1", "--steps", "2", "--warmup", "1", "--max-length", "520"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    row = json.loads(results.read_text().splitlines()[0])
    assert row["fsdp2"] is True and row["deepspeed"] is False and row["world"] == 2
    assert row["reference_fsdp"] == "replicated" and row["fsdp_param_dtype"] is None  # fp32 on the CPU
    assert row["steps_timed"] == 2 and row["real_tok_s_gpu"] > 0
