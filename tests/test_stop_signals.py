"""A stop signal in every phase of train.py outside its training loop: real processes, real signals.

Each case runs ``tests/train_hooks.py`` (train.py with a progress file, a per-step sleep and a pause inside one phase)
under ``tests/reaper.py``, which signals it (or its whole process group) at a known point and reports the exit code
of every process of the launch. train.py must exit 75 with no temporary directory and no lock file left, and a final
save that was interrupted must be finished, or redone by ``--resume_from_checkpoint latest``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from pair_dpo_trainer.demo import bundled_model_dir, bundled_pairs_path
from pair_dpo_trainer.fault_tolerance.checkpoint import checkpoint_problem, list_checkpoints
from pair_dpo_trainer.fault_tolerance.lock import LOCK_FILENAME
from pair_dpo_trainer.fault_tolerance.preemption import PREEMPTED_MARKER
from tests.faults import worker_env

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


def _reap(tmp_path: Path, prefix: list[str], flags: list[str], *, hooks: dict, wait_for: Path, target: str, lines=1):
    """Runs ``prefix tests/train_hooks.py flags`` under the reaper; returns its report and the launch's log."""
    spec = {
        "command": [*prefix, str(ROOT / "tests" / "train_hooks.py"), *flags],
        "env": {**worker_env(), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "PAIR_DPO_TEST_HOOKS": json.dumps(hooks)},
        "log": str(tmp_path / "launch.log"), "wait_for": str(wait_for), "lines": lines, "signal": "TERM",
        "target": target, "timeout": 400, "report": str(tmp_path / "report.json"),
    }  # fmt: skip
    subprocess.run([sys.executable, str(ROOT / "tests" / "reaper.py"), json.dumps(spec)], check=True, timeout=500)
    report, log = json.loads((tmp_path / "report.json").read_text()), (tmp_path / "launch.log").read_text()
    assert report["signalled"], log[-4000:]
    return report, log


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
