"""Resume refuses other data settings and another objective, and allows what may change: train.py in real processes.

A run of 2 steps saves ``checkpoint-2``; each case resumes it to step 4 with one option changed. The demo pairs are
long enough that ``--max_length 96`` truncates pairs that 128 keeps whole, so a changed limit trains other tokens.
Each refusal code is seen once from a real ``train.py`` process (``--max_length``, ``--beta``); the other changed
options run the same argv through ``train.run`` in this process, which prints the same error and returns the same exit
code without a launch's imports.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pair_dpo_trainer.demo import bundled_model_dir, bundled_pairs_path
from pair_dpo_trainer.fault_tolerance.checkpoint import MANIFEST_FILENAME, list_checkpoints
from pair_dpo_trainer.fault_tolerance.resume import check_resumed_settings
from tests.faults import run_script, worker_env

ROOT = Path(__file__).resolve().parents[1]


def _flags(out: Path, pairs: Path, max_steps: int, *extra: str) -> list[str]:
    return [
        "--model_name_or_path", str(bundled_model_dir()), "--dataset", str(pairs), "--eval_size", "0",
        "--max_steps", str(max_steps), "--per_device_train_batch_size", "4", "--max_length", "128",
        "--save_steps", "2", "--logging_steps", "1", "--disable_tqdm", "true", "--report_to", "none",
        "--use_cpu", "true", "--output_dir", str(out), *extra,
    ]  # fmt: skip


def _train(out: Path, pairs: Path, max_steps: int, *extra: str) -> subprocess.CompletedProcess:
    flags = _flags(out, pairs, max_steps, *extra)
    env = {**worker_env(), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return run_script(ROOT / "train.py", flags, env, out.parent)


def _train_in_process(capsys, monkeypatch, *flags: str) -> subprocess.CompletedProcess:
    """``flags`` through ``train.run`` in this process: its exit code and stderr, shaped as :func:`_train`'s result
    (what ``train.py``'s ``__main__`` exits with and prints)."""
    sys.path.insert(0, str(ROOT))
    import train

    monkeypatch.delenv("PAIR_DPO_DEBUG", raising=False)
    capsys.readouterr()
    code = train.run(list(flags))
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(["train.py"], code, captured.out, captured.err)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, Path]:
    """A run directory holding ``checkpoint-2`` (kept pristine: each case resumes a copy) and its pairs file."""
    root = tmp_path_factory.mktemp("resume_settings")
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(bundled_pairs_path().read_text().splitlines(keepends=True)[:32]))
    done = _train(root / "run", pairs, 2)
    assert done.returncode == 0, done.stderr[-4000:]
    return root / "run", pairs


def _resume(
    saved: tuple[Path, Path], tmp_path: Path, *changed: str, in_process=None
) -> tuple[subprocess.CompletedProcess, Path]:
    """Resumes a copy of the saved run to step 4 with ``changed``: in a ``train.py`` process, or with
    ``in_process=(capsys, monkeypatch)`` through :func:`_train_in_process`."""
    run, pairs = saved
    out = tmp_path / "run"
    subprocess.run(["cp", "-a", str(run), str(out)], check=True)
    flags = ("--resume_from_checkpoint", "latest", *changed)
    if in_process is not None:
        return _train_in_process(*in_process, *_flags(out, pairs, 4, *flags)), out
    return _train(out, pairs, 4, *flags), out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("changed", "code", "named", "launch"),
    [
        (["--max_length", "96"], "resume_data_mismatch", "max_length 128 -> 96", True),
        (["--max_prompt_length", "32"], "resume_data_mismatch", "max_prompt_length 64 -> 32", False),
        (["--beta", "0.5"], "resume_objective_mismatch", "beta 0.1 -> 0.5", True),
        (["--loss_type", "ipo"], "resume_objective_mismatch", "loss_type ['sigmoid'] -> ['ipo']", False),
    ],
)
@pytest.mark.integration
def test_a_changed_data_limit_or_objective_is_refused_before_anything_loads(
    saved, tmp_path, capsys, monkeypatch, changed, code, named, launch
):
    """One real ``train.py`` launch per reason code (``launch``); the second option of each code in this process."""
    resumed, out = _resume(saved, tmp_path, *changed, in_process=None if launch else (capsys, monkeypatch))
    assert resumed.returncode == 1, resumed.stderr[-4000:]
    assert f"[{code}]" in resumed.stderr and named in resumed.stderr, resumed.stderr[-4000:]
    assert [step for step, _ in list_checkpoints(out)] == [2]  # nothing trained


@pytest.mark.slow
def test_allow_resume_data_mismatch_resumes_and_lists_each_difference(saved, tmp_path):
    resumed, out = _resume(saved, tmp_path, "--max_length", "96", "--beta", "0.5", "--allow_resume_data_mismatch", "1")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "max_length 128 -> 96" in resumed.stderr and "beta 0.1 -> 0.5" in resumed.stderr
    assert [step for step, _ in list_checkpoints(out)] == [2, 4]


def _history(out: Path, step: int) -> dict[int, dict]:
    history = json.loads((out / f"checkpoint-{step}" / "trainer_state.json").read_text())["log_history"]
    return {entry["step"]: entry for entry in history if "learning_rate" in entry}


@pytest.mark.slow
def test_learning_rate_logging_and_save_cadence_changed_on_resume_apply_as_in_an_uninterrupted_run(saved, tmp_path):
    """HF's Trainer restores the checkpoint's base learning rate and cadence (and only warns): here this run's apply,
    and the resumed steps log the learning rates of a run that had these options from the start."""
    changed = ["--learning_rate", "3e-6", "--logging_steps", "1", "--save_steps", "1", "--warmup_steps", "1"]
    resumed, out = _resume(saved, tmp_path, *changed)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "trained with other settings" not in resumed.stderr
    assert [step for step, _ in list_checkpoints(out)] == [2, 3, 4]  # save_steps 1, not the checkpoint's 2
    straight = _train(tmp_path / "straight", saved[1], 4, *changed)
    assert straight.returncode == 0, straight.stderr[-4000:]
    ours, theirs = _history(out, 4), _history(tmp_path / "straight", 4)
    for step in (3, 4):
        assert ours[step]["learning_rate"] == pytest.approx(theirs[step]["learning_rate"], rel=1e-12), step
    settings = json.loads((out / "checkpoint-4" / MANIFEST_FILENAME).read_text())["resume_settings"]
    assert settings["data"]["max_length"] == 128 and settings["objective"]["beta"] == 0.1
    assert len(settings["data"]["tokenizer"]) == 64


def test_another_tokenizer_is_a_data_change_and_a_manifest_without_settings_only_warns(tmp_path, caplog):
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    recorded = {"data": {"max_length": 128, "tokenizer": "a" * 64}, "objective": {"beta": 0.1}}
    (checkpoint / MANIFEST_FILENAME).write_text(json.dumps({"files": {}, "resume_settings": recorded}))
    current = {"data": {"max_length": 128, "tokenizer": "b" * 64}, "objective": {"beta": 0.1}}
    with pytest.raises(Exception) as refused:
        check_resumed_settings(str(checkpoint), current, allow_mismatch=False)
    assert refused.value.reason_code == "resume_data_mismatch"
    assert "tokenizer fingerprint aaaaaaaaaaaa -> fingerprint bbbbbbbbbbbb" in str(refused.value)
    check_resumed_settings(str(checkpoint), recorded, allow_mismatch=False)  # the same settings pass
    (checkpoint / MANIFEST_FILENAME).write_text(json.dumps({"files": {}}))
    check_resumed_settings(str(checkpoint), current, allow_mismatch=False)
    assert "records no run settings" in caplog.text
