"""The benchmark runner: one suite of ``suites.py``, every run in one process tree, one results file, one report.

Usage (from the repository root; on the GPU machine through ``bash benchmarks/device.sh``, which sets its environment
and installs the carried wheels first)::

    python -m benchmarks.run --list
    python -m benchmarks.run --suite h200-smoke --dry-run      # the exact commands (``DRY_RUN: ...``), nothing run
    python -m benchmarks.run --suite h200-smoke --out /tmp/b   # default --out: $OUT, else bench_out/SUITE

Each run's output is appended to ``OUT/LOG`` (one header and one ``=== rc=`` line per run); every run's rows go to
``OUT/results.jsonl`` (the same JSON rows for ours and TRL); ``train`` runs leave ``OUT/state_TAG.json``. A run is cut
to the suite's deadline (skipped when under 15 s are left), so the report always prints: the markdown table for
docs/benchmarks.md, the suite's ``RATIO`` lines (per GPU), memory ratios, loss-curve comparisons, written to
``OUT/report.md`` too. TRL runs are skipped, with the install hint, when ``trl`` is not importable.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.plan import commands, problems
from benchmarks.report import load_rows, memory_lines, ratio_line, summary_table
from benchmarks.spec import Run, Setup, Suite
from benchmarks.suites import SUITES
from benchmarks.trl_dpo import INSTALL_HINT, trl_available

KEY_LINES = (
    "RATIO", "SAME_OUTPUTS", "PROBE", "WARNING", "SKIPPED", "Traceback", "CEILING skipped", "pair_dpo: world_size",
    "LIGER_MISSING", "torch.OutOfMemoryError",
)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=sorted(SUITES), help="the suite to run (--list shows them)")
    p.add_argument("--list", action="store_true", help="list the suites and exit")
    p.add_argument("--dry-run", action="store_true", help="print the exact commands, run nothing")
    p.add_argument("--out", help="results directory (default: $OUT, else bench_out/SUITE)")
    p.add_argument("--work", help="scratch directory for snapshots and train.py outputs (default: /tmp/pair_dpo_bench)")
    p.add_argument("--deadline", type=int, help="seconds for the whole suite (default: the suite's own)")
    args = p.parse_args(argv)
    if not args.list and not args.suite:
        p.error("give --suite NAME (or --list)")
    return args


def list_suites() -> str:
    """One line per suite: name, GPUs, deadline, run count, summary."""
    return "\n".join(
        f"{s.name:26s} {s.gpus} GPU  {s.deadline_s:4d} s  {len(s.runs):2d} runs  {s.summary}" for s in SUITES.values()
    )


# --------------------------------------------------------------------------------------------------- set-up
def _setup(step: Setup, context: dict[str, str], dry_run: bool) -> None:
    """Runs one set-up step (or prints it), recording what it defines in ``context``."""
    path = f"{context['work']}/{step.name}"
    if step.kind == "random_model":
        argv = [sys.executable, "-m", "benchmarks.tools.random_model", "--out", path, *step.args]
        context[step.name], context["rev"] = path, "REVISION"
        if dry_run:
            print(f"DRY_RUN: {shlex.join(argv)}", flush=True)
            return
        shutil.rmtree(path, ignore_errors=True)  # a warm machine: the writer never overwrites; same bytes again
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        context["rev"] = out.strip().splitlines()[-1]
        print(f"setup: {step.name} at {path}, revision {context['rev']}", flush=True)
    elif step.kind == "zero3_variant":
        key, value = step.args
        context[step.name] = f"{path}.yaml"
        if dry_run:
            print(f"DRY_RUN: setup zero3_variant {path}.json: zero_optimization.{key} = {value}", flush=True)
            return
        config = json.loads(Path("accelerate_configs/deepspeed/zero3_overlap.json").read_text())
        config["zero_optimization"][key] = json.loads(value)
        Path(f"{path}.json").write_text(json.dumps(config, indent=2))
        text = Path("accelerate_configs/zero3_overlap.yaml").read_text()
        Path(f"{path}.yaml").write_text(text.replace("accelerate_configs/deepspeed/zero3_overlap.json", f"{path}.json"))
    else:
        raise ValueError(f"unknown set-up step {step.kind!r}")


# --------------------------------------------------------------------------------------------------- runs
def _execute(argv: list[str], log: Path, timeout: int, env: dict[str, str]) -> int | str:
    """Runs ``argv`` in its own session with output appended to ``log``; on timeout the session's process group is
    sent SIGTERM, then SIGKILL. Returns the exit status, or ``"timeout"``."""
    with open(log, "a") as handle:
        handle.write(f"=== {shlex.join(argv)} (timeout {timeout}s)\n")
        handle.flush()
        proc = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code: int | str = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = "timeout"
            for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
                try:
                    os.killpg(proc.pid, sig)  # the group of the process this runner started, nothing else
                    proc.wait(timeout=grace)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
        handle.write(f"=== rc={code}\n")
    return code


def _run_one(run: Run, argv: list[str], ctx: dict, deadline: float) -> None:
    """One run with its cap cut to the deadline; prints its rc line; copies a train run's trainer_state.json."""
    out, left = Path(ctx["out"]), int(deadline - time.time())
    if run.tool == "trl" and not trl_available():
        print(f"SKIPPED {run.tag}: {INSTALL_HINT}", flush=True)
        return
    if left < 15:
        print(f"SKIPPED (deadline) {run.tag}: {shlex.join(argv)}", flush=True)
        return
    start = time.time()
    code = _execute(argv, out / run.log, min(run.timeout_s, left), ctx["env"])
    print(f"rc={code} {time.time() - start:.0f}s {run.tag} ({run.log})", flush=True)
    state = Path(ctx["work"], run.tag, "trainer_state.json")
    if run.tool == "train" and state.is_file():
        (out / f"state_{run.tag}.json").write_text(state.read_text())


def _environment(out: Path) -> dict[str, str]:
    """The runs' environment: this process's, ``OUT``, and the repository on PYTHONPATH."""
    env = dict(os.environ)  # the suite's own settings are in each command's ``env`` prefix
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.update(OUT=str(out), PYTHONUNBUFFERED="1")
    return env


# --------------------------------------------------------------------------------------------------- report
def _first_values(path: Path) -> str:
    history = json.loads(path.read_text()).get("log_history", [])
    loss = [round(e["loss"], 4) for e in history if "loss" in e][:2]
    evals = [round(e["eval_loss"], 4) for e in history if "eval_loss" in e][:1]
    return f"first losses {loss}, first eval_loss {evals or None}"


def report(suite: Suite, out: Path, work: str) -> str:
    """The key log lines, the table of ``results.jsonl``, the ratios and the train runs' curves, as one text."""
    lines = [f"# suite {suite.name}: {suite.summary}", ""]
    for log in sorted({run.log for run in suite.runs}):
        path = out / log
        if path.is_file():
            lines += [
                f"{log}: {t[:300]}" for t in path.read_text(errors="replace").splitlines() if t.startswith(KEY_LINES)
            ]
    results = out / "results.jsonl"
    if results.is_file():
        lines += ["", summary_table(str(results)), ""]
    rows = load_rows(str(results))
    lines += [ratio_line(rows, num, den) for num, den in suite.ratios]
    lines += memory_lines(rows, suite.memory_ratios)
    for run in suite.runs:
        state = out / f"state_{run.tag}.json"
        if run.tool == "train" and state.is_file():
            lines.append(f"TRAIN {run.tag}: {_first_values(state)}")
    for curves in suite.curves:
        argv = [sys.executable, "-m", "benchmarks.tools.loss_curves", *(f"{work}/{t}" for t in curves.tags)]
        argv += ["--labels", *curves.labels, "--out", str(out / curves.png), "--key", curves.key]
        proc = subprocess.run(argv, capture_output=True, text=True)
        lines.append(f"CURVES {curves.png} (rc={proc.returncode}): {(proc.stdout + proc.stderr).strip()[-600:]}")
    if suite.look_for:
        lines.append(f"look for: {suite.look_for}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Plans the suite, then prints (``--dry-run``) or runs its commands and prints the report. Returns 0, or 2 when
    the suite's data has problems."""
    args = parse_args(argv)
    if args.list:
        print(list_suites())
        return 0
    suite = SUITES[args.suite]
    if found := problems(suite):
        print("\n".join(f"suite {suite.name}: {p}" for p in found), file=sys.stderr)
        return 2
    out = Path(args.out or os.environ.get("OUT") or f"bench_out/{suite.name}").resolve()
    work = str(Path(args.work or "/tmp/pair_dpo_bench").resolve() / suite.name)
    context = {"work": work, "out": str(out)}
    budget = suite.deadline_s if args.deadline is None else args.deadline
    deadline = time.time() + budget
    if not args.dry_run:
        out.mkdir(parents=True, exist_ok=True)
        Path(work).mkdir(parents=True, exist_ok=True)
    print(f"suite {suite.name}: {len(suite.runs)} runs, {suite.gpus} GPU, deadline {budget}"
          f" s, results in {out}", flush=True)  # fmt: skip
    for step in suite.setup:
        _setup(step, context, args.dry_run)
    ctx = {"out": str(out), "work": work, "env": _environment(out)}
    for run, command in commands(suite, context):
        if args.dry_run:
            print(f"DRY_RUN: {shlex.join(command)}", flush=True)
        else:
            _run_one(run, command, ctx, deadline)
    if not args.dry_run:
        text = report(suite, out, work)
        (out / "report.md").write_text(text + "\n")
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
