"""The benchmark runner's plumbing on the CPU: every suite's exact commands parse with the tool they start (dry run),
its tags and ratios fit together, and a small suite runs end to end (rows, table, ratios, skips)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import dpo, longest_pair, plan, run, trl_dpo
from benchmarks.spec import Run, Suite, ours, ratios, trl
from benchmarks.suites import SUITES

ROOT = Path(__file__).resolve().parents[2]
CONTEXT = {"work": "/tmp/w", "out": "/tmp/o"}
for _suite in SUITES.values():  # what the set-up steps define ({rev}, {model05b}, {zero3_persist}, ...), as a dry run
    for _step in _suite.setup:
        run._setup(_step, CONTEXT, dry_run=True)


def _train_fields() -> set[str]:
    import train  # the script at the repository root (python -m pytest puts the root on sys.path)

    return {f.name for cls in train.ARGUMENT_CLASSES for f in dataclasses.fields(cls)}


def _split(run_: Run, argv: list[str]) -> tuple[list[str], str, list[str]]:
    """``(launcher argv, module-or-script, its args)`` of a planned command; the launcher must end with its module
    switch when the target is a module."""
    is_module, target = plan._target(run_, CONTEXT)
    assert argv[-len(target) :] == target
    launcher = argv[: -len(target)]
    assert launcher[-1] in ("-m", "--module") if is_module else launcher[-1] == sys.executable or launcher[-1].isdigit()
    return launcher, target[0], target[1:]


def _check_command(run_: Run, argv: list[str], train_fields: set[str]) -> None:
    launcher, target, args = _split(run_, argv)
    if run_.launcher == "accelerate":
        config = launcher[launcher.index("--config_file") + 1]
        assert config.startswith(CONTEXT["work"]) or (ROOT / config).is_file(), config
    if target == "benchmarks.dpo":
        assert dpo.parse_args(args).tag == run_.tag
    elif target == "benchmarks.trl_dpo":
        assert trl_dpo.parse_args(args).tag == run_.tag
    elif target == "train.py":
        flags = {a[2:] for a in args if a.startswith("--")}
        assert flags <= train_fields, flags - train_fields
    elif target == "pytest":
        assert all((ROOT / a).exists() for a in args if a.startswith("tests/"))
    else:
        importlib.import_module(target).parse_args(args)


@pytest.mark.parametrize("name", sorted(SUITES))
def test_every_suite_plans_commands_its_tools_accept(name):
    suite = SUITES[name]
    assert plan.problems(suite) == []
    planned = plan.commands(suite, CONTEXT)
    assert len(planned) == len(suite.runs) >= 1
    train_fields = _train_fields()
    for run_, argv in planned:
        _check_command(run_, argv, train_fields)
    ports = [a[i + 1] for _, a in planned for i, w in enumerate(a) if w in ("--main_process_port", "--master_port")]
    assert len(ports) == len(set(ports))
    assert all(suite.gpus >= r.processes for r in suite.runs) or suite.gpus == 0


def test_token_budget_suite_keeps_the_former_scripts_runs():
    """The former scripts/gpu/h200_token_budget.sh: >= 10 commands, unique tags, every ratio operand produced, the
    allocator setting on every budget run but the one that measures its absence."""
    suite = SUITES["h200-token-budget"]
    planned = plan.commands(suite, CONTEXT)
    assert len(planned) >= 10 and plan.problems(suite) == []
    env = {r.tag: a[: a.index(sys.executable)] for r, a in planned}
    assert env["heavy_b16k_noexp"] == ["env", "-u", "PYTORCH_CUDA_ALLOC_CONF", "CUDA_VISIBLE_DEVICES=0"]
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in env["heavy_b16k"]


def test_problems_name_duplicate_tags_and_unproduced_ratio_operands():
    suite = Suite("x", "x", 0, 10, (ours("a"), ours("a", "--ceiling"), trl("b")), ratios("a/b", "a:pair_dpo_ceiling/c"))
    assert plan.problems(suite) == ["duplicate tag 'a'", "ratio operand 'c' is produced by no run"]
    shaped = Suite(
        "y", "y", 0, 10, (ours("s", "--ceiling-shape", "2x16"),), ratios("s/s_ceiling2x16:pair_dpo_ceiling_shape")
    )
    assert plan.problems(shaped) == []


@pytest.mark.integration
def test_cli_dry_run_prints_the_planned_commands_and_runs_nothing(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--suite", "h200-smoke", "--dry-run", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = [line[len("DRY_RUN: ") :] for line in proc.stdout.splitlines() if line.startswith("DRY_RUN: ")]
    assert len(lines) == len(SUITES["h200-smoke"].runs)
    assert "-m benchmarks.trl_dpo --tag trl_sdpa" in lines[0] and "-m benchmarks.dpo --tag ours " in lines[1]
    assert not out.exists()
    listing = subprocess.run([sys.executable, "-m", "benchmarks.run", "--list"], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)  # fmt: skip
    assert all(name in listing.stdout for name in SUITES)


def _mini_suite() -> Suite:
    return Suite(
        name="mini",
        summary="one tiny run of ours, one of TRL",
        gpus=0,
        deadline_s=300,
        runs=(
            ours("ours_tiny", "--tiny", "--bs", "1", "--steps", "1", "--warmup", "1", "--ceiling", timeout_s=240),
            trl("trl_tiny", "--tiny", "--steps", "1", "--warmup", "1", "--bs", "1", "--workers", "0", timeout_s=240),
        ),
        ratios=ratios("ours_tiny/ours_tiny:pair_dpo_ceiling", "ours_tiny/trl_tiny"),
    )


@pytest.mark.slow
def test_a_suite_runs_end_to_end_rows_table_ratios_and_report(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(run.SUITES, "mini", _mini_suite())
    assert run.main(["--suite", "mini", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]) == 0
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [(r["tag"], r["impl"]) for r in rows][:2] == [("ours_tiny", "pair_dpo_ceiling"), ("ours_tiny", "pair_dpo")]
    assert "rc=0" in out and "| tag | impl |" in out
    assert "RATIO ours_tiny/ours_tiny:pair_dpo_ceiling = " in out
    if trl_dpo.trl_available():
        assert "RATIO ours_tiny/trl_tiny = " in out
    else:
        assert "SKIPPED trl_tiny: " in out and "RATIO ours_tiny/trl_tiny: missing trl_tiny" in out
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| ours_tiny | pair_dpo |" in report and "=== rc=0" in (tmp_path / "out" / "bench.log").read_text()


def test_a_past_deadline_skips_every_run_and_still_reports(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(run.SUITES, "mini", _mini_suite())
    argv = ["--suite", "mini", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "w"), "--deadline", "0"]
    monkeypatch.setattr(run, "trl_available", lambda: True)
    assert run.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("SKIPPED (deadline)") == 2 and "RATIO ours_tiny/trl_tiny: missing ours_tiny and trl_tiny" in out
    assert (tmp_path / "out" / "report.md").is_file()


# --------------------------------------------------------------------------------------------- speed / memory suites
NEW_SUITES = (
    "h200-speed-qwen", "h200-speed-8b", "h200-speed-8b-checkpointing", "h200-speed-8b-lora", "h200-alloc",
    "h200-gpu-tests",
)  # fmt: skip


def _parsed(name: str) -> dict[str, tuple[Run, object]]:
    """``tag -> (run, parsed args)`` of a suite's ours / TRL runs."""
    parsers = {"ours": dpo.parse_args, "trl": trl_dpo.parse_args}
    return {r.tag: (r, parsers[r.tool](list(r.args))) for r in SUITES[name].runs if r.tool in parsers}


@pytest.mark.parametrize("name", NEW_SUITES)
def test_speed_suites_fit_one_call_and_run_ours_before_trl(name):
    suite = SUITES[name]
    assert suite.gpus == 1 and suite.deadline_s <= 540 and suite.look_for and plan.problems(suite) == []
    tools = [r.tool for r in suite.runs if r.tool in ("ours", "trl")]
    assert tools == sorted(tools, key=lambda t: t == "trl")  # TRL's runs after ours (the deadline cuts the end)
    for run_, args in _parsed(name).values():
        assert args.bs == 8 and args.model_size in ("qwen1.5b", "8b")  # 8 pairs per step
        assert run_.tool == "trl" or args.compile


def test_qwen_suite_runs_ours_with_ceiling_profile_and_fp8_then_trl_with_and_without_liger():
    runs = _parsed("h200-speed-qwen")
    ours_qwen = runs["ours_qwen"][1]
    assert ours_qwen.ceiling and ours_qwen.profile and runs["ours_qwen_fp8"][1].fp8 == "tensorwise"
    assert runs["trl_qwen_liger"][1].liger and not runs["trl_qwen"][1].liger
    wanted = {("ours_qwen", "trl_qwen_liger"), ("ours_qwen", "ours_qwen:pair_dpo_ceiling")}
    wanted.add(("ours_qwen_fp8", "ours_qwen"))
    assert wanted <= set(SUITES["h200-speed-qwen"].ratios)


def test_8b_suites_cover_auto_fp8_the_fixed_settings_lora_and_trl():
    runs = _parsed("h200-speed-8b")
    assert [args.activation_checkpointing for run_, args in runs.values() if run_.tool == "ours"] == ["auto", "auto"]
    fixed = [args.activation_checkpointing for _, args in _parsed("h200-speed-8b-checkpointing").values()]
    assert fixed[0] == "auto" and {"off", "layers:2", "full"} <= set(fixed)
    auto, fp8 = runs["ours_8b_auto"][1], runs["ours_8b_fp8"][1]
    assert auto.max_tokens_per_microbatch == fp8.max_tokens_per_microbatch == 12288 and not auto.fp8
    assert fp8.fp8 == "tensorwise"
    gc, gc_liger = runs["trl_8b_gc"][1], runs["trl_8b_gc_liger"][1]
    assert gc.gradient_checkpointing and not gc.liger and gc_liger.gradient_checkpointing and gc_liger.liger
    wanted = {("ours_8b_auto", "trl_8b_gc"), ("ours_8b_fp8", "ours_8b_auto"), ("ours_8b_auto", "trl_8b_gc_liger")}
    assert wanted <= set(SUITES["h200-speed-8b"].ratios)
    lora = _parsed("h200-speed-8b-lora")
    ours_lora, trl_lora = lora["ours_8b_lora16"][1], lora["trl_8b_lora16_gc"][1]
    assert ours_lora.lora == 16 and ours_lora.compile and trl_lora.lora == 16 and trl_lora.gradient_checkpointing
    assert ("ours_8b_lora16", "trl_8b_lora16_gc") in SUITES["h200-speed-8b-lora"].ratios


def test_alloc_suite_uses_the_library_api_without_the_allocator_variable_then_the_gpu_tests():
    suite = SUITES["h200-alloc"]
    planned = dict((r.tag, argv) for r, argv in plan.commands(suite, CONTEXT))
    lib = planned["alloc_lib"]
    assert lib[:5] == ["env", "-u", "PYTORCH_CUDA_ALLOC_CONF", "-u", "PYTORCH_ALLOC_CONF"]
    assert "benchmarks.alloc_check" in lib and not any(r.tool == "train" for r in suite.runs)
    args = importlib.import_module("benchmarks.alloc_check").parse_args(lib[lib.index("benchmarks.alloc_check") + 1 :])
    assert (args.pairs, args.mix, args.target) == (4, "heavy", 1.15)
    tests = [r for r in (*suite.runs, *SUITES["h200-gpu-tests"].runs) if r.tool == "pytest"]
    assert len(tests) == 2 and all(r.args[-3:] == ("-m", "gpu", "tests/") and r.timeout_s <= 180 for r in tests)


def test_a_failing_run_does_not_stop_the_suite(tmp_path, monkeypatch, capsys):
    """A run that fails (here: a refused flag, exit status 2) prints its rc; the next run still runs."""
    suite = Suite(
        "fails", "a failing run, then one that passes", 0, 120,
        (Run("bad", "module", ("benchmarks.report", "--no-such-flag")),
         Run("good", "module", ("benchmarks.report", "--no-table", str(tmp_path / "none.jsonl")))),
    )  # fmt: skip
    monkeypatch.setitem(run.SUITES, "fails", suite)
    assert run.main(["--suite", "fails", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "w")]) == 0
    out = capsys.readouterr().out
    assert "rc=2 " in out and " bad " in out and "rc=0 " in out and " good " in out


@pytest.mark.integration
def test_device_script_dry_run_prints_the_commands_and_installs_nothing(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "BENCH_SITE": str(site)}
    proc = subprocess.run(["bash", "benchmarks/device.sh", "--suite", "h200-speed-qwen", "--dry-run"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("DRY_RUN: ")]
    assert len(lines) == len(SUITES["h200-speed-qwen"].runs) and not site.exists()


def test_share_suite_runs_the_shared_row_then_trl_then_the_unshared_one_on_the_same_8b_workload():
    """The target's two rows (ours shared, TRL) come before the lower-priority unshared row the deadline cuts first."""
    runs = _parsed("h200-share-8b")
    assert list(runs) == ["ours_8b_shared", "trl_8b_gc", "ours_8b_unshared"]
    shared, unshared = runs["ours_8b_shared"][1], runs["ours_8b_unshared"][1]
    assert shared.share_prompt is True and unshared.share_prompt is False
    assert vars(shared) | {"tag": "", "share_prompt": None} == vars(unshared) | {"tag": "", "share_prompt": None}
    assert shared.compile and shared.model_size == runs["trl_8b_gc"][1].model_size == "8b"
    assert runs["trl_8b_gc"][1].gradient_checkpointing and SUITES["h200-share-8b"].deadline_s <= 540


def test_longest_8b_suites_try_ours_at_twice_the_length_trl_is_tried_at():
    """The two tries decide ">= 2x TRL + liger" only if ours' length is at least twice TRL's, on the same model."""
    tries = {}
    for name in ("h200-longest-8b-trl", "h200-longest-8b-ours"):
        (run_,) = SUITES[name].runs
        args = longest_pair.parse_args(list(run_.args[1:]))
        assert run_.args[0] == "benchmarks.longest_pair" and args.max_tries == 1 and args.model_size == "8b"
        assert args.try_timeout < run_.timeout_s <= SUITES[name].deadline_s <= 560  # the try ends before its run
        tries[args.side] = args
    assert tries["trl"].strategy == "liger+gc" and tries["ours"].strategy == "full+offload+tiled"
    assert tries["ours"].start >= 2 * tries["trl"].start and tries["ours"].prompt_frac == tries["trl"].prompt_frac
