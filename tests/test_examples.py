"""The examples run as a user runs them: a fresh process, offline, on the bundled model and pairs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SCRIPT = EXAMPLES / "existing_trainer_script.py"
TRL_SCRIPT = EXAMPLES / "trl_dpo_script.py"


def _offline_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_DATASETS_CACHE=str(tmp_path / "datasets-cache"),
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT),  # this checkout's package, whatever an installed copy is
    )
    return env


@pytest.mark.integration
def test_existing_trainer_script_trains_a_few_steps(tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, str(SCRIPT), "--output_dir", str(out), "--max_steps", "5"]
    command += ["--max_train_samples", "160", "--disable_tqdm", "true"]
    done = subprocess.run(
        command, cwd=tmp_path, env=_offline_env(tmp_path), capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    state = json.loads((out / "trainer_state.json").read_text())
    losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
    assert state["global_step"] == 5 and len(losses) == 5
    assert losses[0] == pytest.approx(0.6931, abs=1e-3)  # the reference is the starting model: ln 2 at step 0
    assert (out / "model.safetensors").is_file()


def _run(script: Path, tmp_path: Path, *args: str) -> dict:
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "out"
    command = [sys.executable, str(script), "--output_dir", str(out), "--disable_tqdm", "true", *args]
    done = subprocess.run(
        command, cwd=tmp_path, env=_offline_env(tmp_path), capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (out / "model.safetensors").is_file() or (out / "adapter_model.safetensors").is_file()
    return json.loads((out / "trainer_state.json").read_text())


@pytest.mark.slow
def test_trl_dpo_script_trains_a_few_steps_full_and_lora(tmp_path):
    """The converted TRL script on its offline defaults (a 160-pair slice of the demo data), then with --use_peft."""
    data = tmp_path / "pairs.jsonl"
    data.write_text(
        "".join(open(TRL_SCRIPT.parent.parent / "pair_dpo_trainer/assets/demo_pairs.jsonl").readlines()[:160])
    )
    for name, args, steps in (("full", (), 5), ("lora", ("--use_peft", "true"), 2)):
        state = _run(TRL_SCRIPT, tmp_path / name, "--dataset_name", str(data), "--max_steps", str(steps), *args)
        losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
        assert state["global_step"] == steps and len(losses) == steps, name
        assert losses[0] == pytest.approx(0.6931, abs=1e-3), name  # policy == reference at step 0 (LoRA B = 0 too)


@pytest.mark.parametrize("script", [SCRIPT, TRL_SCRIPT], ids=lambda p: p.name)
def test_example_script_diff_is_small_and_true(script):
    """The diff in the docstring has < 20 changed lines, its '+' lines are in the code and its '-' lines are not."""
    text = script.read_text()
    docstring, code = text.split('"""', 2)[1], text.split('"""', 2)[2]
    changed = re.findall(r"^    ([+-])(.*)$", docstring, flags=re.MULTILINE)
    assert 0 < len(changed) < 20
    claimed = re.search(r"(\d+) changed lines \((\d+) removed, (\d+) added", docstring)
    assert claimed and [int(n) for n in claimed.groups()] == [
        len(changed),
        sum(sign == "-" for sign, _ in changed),
        sum(sign == "+" for sign, _ in changed),
    ]
    code_lines = {line.strip() for line in code.splitlines()}
    for sign, line in changed:
        if sign == "+":
            assert line.strip() in code_lines, line
        else:
            assert line.strip() not in code_lines, line
