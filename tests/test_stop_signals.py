"""A stop signal through every documented launcher, in every phase of train.py and in ``pair-dpo prepare-data``: real
launchers, real signals.

Each case runs ``tests/train_hooks.py`` (train.py with a progress file, a per-step sleep and a pause inside one phase)
under ``tests/reaper.py``, which signals the launcher (or its whole process group) at a known point and reports the
exit code of every process of the launch, orphans included. The training loop under a launcher must end with a
complete checkpoint, every rank's ``[preempted]`` line and the preemption marker (what a requeue script checks where
the launcher replaces 75 by its own code); outside the loop train.py must exit 75 with no temporary directory and no
lock file left, a final save must be finished (or, interrupted earlier, redone by ``--resume_from_checkpoint latest``),
and ``prepare-data`` must exit 75 without its half-written output.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from pair_dpo_trainer.demo import bundled_model_dir, bundled_pairs_path
from pair_dpo_trainer.fault_tolerance.checkpoint import checkpoint_problem, list_checkpoints, read_manifest
from pair_dpo_trainer.fault_tolerance.launcher import accelerate_passes_sigterm_on
from pair_dpo_trainer.fault_tolerance.lock import LOCK_FILENAME
from pair_dpo_trainer.fault_tolerance.preemption import PREEMPTED_MARKER
from tests.faults import worker_env
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("signal_data") / "pairs.jsonl"
    path.write_text("".join(bundled_pairs_path().read_text().splitlines(keepends=True)[:64]))
    return path


def _flags(out: Path, pairs: Path, *extra: str) -> list[str]:
    return [
        "--model_name_or_path", str(bundled_model_dir()), "--dataset", str(pairs), "--eval_size", "0",
        "--max_steps", str(STEPS), "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
        "--max_length", "128", "--logging_steps", "1", "--save_steps", "100", "--disable_tqdm", "true",
        "--report_to", "none", "--dataloader_num_workers", "1", *extra, "--output_dir", str(out),
    ]  # fmt: skip


def _reap(
    tmp_path: Path,
    prefix: list[str],
    flags: list[str],
    *,
    hooks: dict,
    wait_for: Path,
    target: str,
    lines=1,
    script=True,
):
    """Runs ``prefix tests/train_hooks.py flags`` (``prefix flags`` without ``script``) under the reaper; returns its
    report and the launch's log."""
    spec = {
        "command": [*prefix, *([str(ROOT / "tests" / "train_hooks.py")] if script else []), *flags],
        "env": {**worker_env(), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "PAIR_DPO_TEST_HOOKS": json.dumps(hooks)},
        "log": str(tmp_path / "launch.log"), "wait_for": str(wait_for), "lines": lines, "signal": "TERM",
        "target": target, "timeout": 400, "report": str(tmp_path / "report.json"),
    }  # fmt: skip
    subprocess.run([sys.executable, str(ROOT / "tests" / "reaper.py"), json.dumps(spec)], check=True, timeout=500)
    report, log = json.loads((tmp_path / "report.json").read_text()), (tmp_path / "launch.log").read_text()
    assert report["signalled"], log[-4000:]
    return report, log


def _child_code(report: dict) -> int | None:
    """The exit code of the launcher's own child (re-parented to the reaper when the launcher died first)."""
    return next((p["code"] for p in report["processes"] if p["parent"] == report["launcher_pid"]), None)


def _assert_stopped_with_a_checkpoint(out: Path, log: str, ranks: int) -> None:
    """The training loop stopped early: a complete checkpoint (every rank's), its marker, each rank's line."""
    (step, checkpoint), *_ = list_checkpoints(out)
    assert 1 <= step < STEPS and checkpoint_problem(checkpoint) is None, log[-4000:]
    assert {f"rng_state_{r}.pth" for r in range(ranks) if ranks > 1} <= set(read_manifest(checkpoint)["files"])
    marker = json.loads((out / PREEMPTED_MARKER).read_text())
    assert marker["checkpoint"] == str(checkpoint) and marker["exit_code"] == 75 and marker["signal"] == "SIGTERM"
    for rank in range(ranks):  # a rank the signal did not reach stops with the others at the same step
        assert re.search(rf"pair_dpo: rank {rank}: \[preempted\] [^:]+: stopped after optimizer step {step} ", log), log
    assert "is killed by signal" not in log  # no DataLoader worker died of the job's signal
    assert not (out / LOCK_FILENAME).exists()


# ---------------------------------------------------------------------------------------------- launchers
@pytest.mark.slow
def test_accelerate_launch_with_one_process_passes_sigterm_on_when_its_launcher_dies(tmp_path, pairs_file):
    """Before accelerate 1.16 its single-process launcher forwards nothing and dies 143: the run follows it (a SIGTERM
    when its parent dies), saves and exits 75 itself, which is what the orphan's reaper sees. From 1.16 it passes
    SIGTERM on to the run's process tree, waits 5 s for it (a step and a save of the tiny model fit), exits 143, and
    the run says at start how short that grace is."""
    out, progress = tmp_path / "out", tmp_path / "progress"
    prefix = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1"]
    prefix += ["--mixed_precision", "no", "--dynamo_backend", "no"]
    hooks = {"progress": str(progress), "step_sleep": 0.5}
    report, log = _reap(tmp_path, prefix, _flags(out, pairs_file), hooks=hooks, wait_for=progress, target="launcher")
    if accelerate_passes_sigterm_on():
        assert report["launcher"] == 143 and _child_code(report) is None, report  # it waited for its child
        assert "accelerate launch with one process passes SIGTERM on to this process and every process under it" in log
    else:
        assert report["launcher"] == -15, report  # accelerate's launcher itself dies of the signal
        assert _child_code(report) == 75, report  # the orphaned run itself
        assert "accelerate launch with one process does not pass SIGTERM on to the training processes" in log
    _assert_stopped_with_a_checkpoint(out, log, ranks=1)


@pytest.mark.slow
@pytest.mark.distributed
def test_accelerate_launch_with_two_processes_stops_every_rank_with_a_checkpoint(tmp_path, pairs_file):
    """``cpu_2proc.yaml``: accelerate runs torchrun in-process (SIGTERM to each rank's group) and exits 1 (143 from
    accelerate 1.16, which exits 128 + the signal's number)."""
    out, progress = tmp_path / "out", tmp_path / "progress"
    prefix = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    prefix += [str(ROOT / "accelerate_configs" / "cpu_2proc.yaml"), "--main_process_port", str(free_port())]
    hooks = {"progress": str(progress), "step_sleep": 0.5}
    report, log = _reap(
        tmp_path, prefix, _flags(out, pairs_file), hooks=hooks, wait_for=progress, target="launcher", lines=2
    )
    assert report["launcher"] == (143 if accelerate_passes_sigterm_on() else 1), report
    _assert_stopped_with_a_checkpoint(out, log, ranks=2)


@pytest.mark.slow
@pytest.mark.distributed
def test_the_deepspeed_launcher_stops_every_rank_with_a_checkpoint_when_its_command_gets_sigterm(tmp_path, pairs_file):
    """The ``deepspeed`` command forwards nothing on one node and dies 143; its ``launch.py`` lives on: the ranks
    follow the command, stop with a checkpoint, and ``launch.py`` (re-parented) exits with their 75."""
    out, progress = tmp_path / "out", tmp_path / "progress"
    prefix = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port())]
    hooks = {"progress": str(progress), "step_sleep": 0.5}
    flags = [*_flags(out, pairs_file), "--use_cpu", "true"]  # the launcher names GPUs: the CPU is the user's choice
    report, log = _reap(tmp_path, prefix, flags, hooks=hooks, wait_for=progress, target="launcher", lines=2)
    assert report["launcher"] == -15 and _child_code(report) == 75, report  # launch.py, re-parented
    _assert_stopped_with_a_checkpoint(out, log, ranks=2)


# ---------------------------------------------------------------------------------------------- phases of train.py
@pytest.mark.slow
@pytest.mark.parametrize("phase", ["tokenise", "evaluate", "save"])
def test_sigterm_outside_the_training_loop_exits_75_and_leaves_nothing_half_done(tmp_path, pairs_file, phase):
    """``python train.py``, SIGTERM to its process group while it tokenises (inside the cache build), runs the final
    evaluation, or writes the final model: exit 75, no temporary cache directory, no lock file; a final save is
    finished (else ``--resume_from_checkpoint latest`` redoes it from the last step's checkpoint)."""
    out, paused, cache = tmp_path / "out", tmp_path / "paused", tmp_path / "cache"
    flags = _flags(out, pairs_file, "--dataset_cache_dir", str(cache), "--eval_size", "8", "--eval_strategy", "no")
    hooks = {"pause": {"phase": phase, "file": str(paused), "seconds": 4 if phase == "save" else 60}}  # save: finished
    report, log = _reap(tmp_path, [sys.executable], flags, hooks=hooks, wait_for=paused, target="group")
    assert report["launcher"] == 75, log[-4000:]
    assert "pair_dpo: rank 0: [preempted] SIGTERM: " in log
    assert not [p.name for p in cache.glob(".pairs-*")]  # the interrupted cache build left no temporary directory
    assert not (out / LOCK_FILENAME).exists()
    marker = json.loads((out / PREEMPTED_MARKER).read_text())
    assert marker["exit_code"] == 75 and marker["signal"] == "SIGTERM", marker
    if phase == "tokenise":
        assert "tokenising" in marker["phase"] and list_checkpoints(out) == []
        return
    (step, checkpoint), *_ = list_checkpoints(out)
    assert step == STEPS and checkpoint_problem(checkpoint) is None  # the training itself was complete
    if phase == "save":
        assert marker["phase"] == "the final save" and "finished the final save, then stopped" in marker["message"]
        assert load_file(out / "model.safetensors") and (out / "trainer_state.json").exists()  # finished whole
        return
    assert "evaluation" in marker["phase"] and not (out / "model.safetensors").exists()
    sys.path.insert(0, str(ROOT))
    import train

    metrics = train.main([*flags, "--resume_from_checkpoint", "latest"])  # the requeued job: only the end is redone
    assert "eval_loss" in metrics and json.loads((out / "trainer_state.json").read_text())["global_step"] == STEPS
    assert not (out / PREEMPTED_MARKER).exists() and not (out / LOCK_FILENAME).exists()
    straight = tmp_path / "straight"
    assert (
        train.main([*flags[:-1], str(straight)])["eval_loss"] == metrics["eval_loss"]
    )  # _flags ends with the output_dir
    final, expected = load_file(out / "model.safetensors"), load_file(straight / "model.safetensors")
    assert final.keys() == expected.keys() and all(final[k].equal(expected[k]) for k in final)


PAUSED_PREPARE = """
import pathlib, sys, time
from pair_dpo_trainer.data import prepare
write_splits, pause_file = prepare.write_splits, pathlib.Path(sys.argv.pop(1))

def paused(*args, **kwargs):  # the splits written into the temporary output directory, then a pause
    result = write_splits(*args, **kwargs)
    pause_file.write_text("paused")
    time.sleep(60)
    return result

prepare.write_splits = paused
from pair_dpo_trainer.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_sigterm_during_prepare_data_exits_75_and_leaves_no_partial_output(tmp_path, pairs_file):
    out, paused = tmp_path / "prepared", tmp_path / "paused"
    command = [sys.executable, "-c", PAUSED_PREPARE, str(paused), "prepare-data", str(pairs_file), "--output", str(out)]
    command += ["--tokenizer", str(bundled_model_dir()), "--train-size", "40", "--eval-size", "8", "--seed", "0"]
    report = _reap(tmp_path, command[:1], command[1:], hooks={}, wait_for=paused, target="group", script=False)[0]
    assert report["launcher"] == 75, (tmp_path / "launch.log").read_text()[-4000:]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".prepared")) == []  # no temporary output
    assert not out.exists()
