"""The examples run as a user runs them: a fresh process, offline, on the bundled model and pairs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCRIPT = EXAMPLES / "existing_trainer_script.py"


def _offline_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_DATASETS_CACHE=str(tmp_path / "datasets-cache"),
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
    )
    return env


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


def test_existing_trainer_script_diff_is_small_and_true():
    """The diff in the docstring has < 20 changed lines, its '+' lines are in the code and its '-' lines are not."""
    text = SCRIPT.read_text()
    docstring, code = text.split('"""', 2)[1], text.split('"""', 2)[2]
    changed = re.findall(r"^    ([+-])(.*)$", docstring, flags=re.MULTILINE)
    assert 0 < len(changed) < 20
    code_lines = {line.strip() for line in code.splitlines()}
    for sign, line in changed:
        if sign == "+":
            assert line.strip() in code_lines, line
        else:
            assert line.strip() not in code_lines, line
