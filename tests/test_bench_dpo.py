"""CPU smoke test of ``scripts/bench_dpo.py`` (tiny model, fp32, 1 pair, 2 warmup + 1 timed step, ceiling, profile)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"

# The fields of trl_dpo_baseline.py's RESULT row (../shared/bench): ours must carry every one of them.
TRL_RESULT_FIELDS = (
    "tag rank world attn padding_free_requested padding_free_effective deepspeed bs_pairs steps_timed step_median_s "
    "step_mean_s step_min_s step_max_s real_tokens_per_step padded_tokens_per_step padding_frac real_tok_s_gpu "
    "real_tok_s_gpu_from_median mfu8N_989 mfu8N_790 n_params n_params_no_embed peak_alloc_gib peak_reserved_gib "
    "train_wall_s shapes_first no_cudnn_sdp step_s seq_len warmup_step_s"
).split()


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_dpo", SCRIPTS / "bench_dpo.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_dpo"] = module
    spec.loader.exec_module(module)
    return module


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


def test_max_tokens_microbatch_picks_pairs_per_microbatch(bench):
    args = bench.parse_args(["--max-tokens-microbatch", "16384"])
    bs = bench.pairs_per_microbatch(args)
    assert 10 <= bs <= 20  # mean pair cost of the workload is ~1.1k tokens


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
    lines = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [line["impl"] for line in lines] == ["pair_dpo_ceiling", "pair_dpo"]
    assert any(line.startswith("RESULT {") for line in out.splitlines())
    assert any(line.startswith("CEILING {") for line in out.splitlines())
    summary = (tmp_path / "profile_summary.txt").read_text()
    assert "Sync candidates inside the micro-batch loop" in summary
    assert "bench::microbatch" in summary and "Top-15 ops" in summary


def test_trl_script_runs_unchanged_with_the_model_size_dims(bench, tmp_path, capsys):
    script = tmp_path / "fake_trl.py"
    script.write_text(
        "import sys\n"
        "from transformers import LlamaConfig\n"
        "cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, vocab_size=32000)\n"
        "print('FAKE', cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size, sys.argv[1:])\n"
    )
    bench.main(["--model-size", "1.5b", "--trl-script", str(script), "--trl-args=--tag trl_1p5b --attn sdpa"])
    assert "FAKE 2048 5632 24 152064 ['--tag', 'trl_1p5b', '--attn', 'sdpa']" in capsys.readouterr().out
    import transformers

    assert isinstance(transformers.LlamaConfig, type)  # restored
