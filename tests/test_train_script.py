"""The default `train.py` run end to end (shortened) and `pair-dpo plot`."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import train  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "run"
    metrics = train.main(
        [
            "--output_dir",
            str(out),
            "--max_steps",
            "80",
            "--eval_steps",
            "40",
            "--save_steps",
            "40",
            "--disable_tqdm",
            "true",
            "--use_cpu",
            "true",
        ]
    )
    return out, metrics


@pytest.mark.slow  # reads the module's demo run (~40 s on 2 cores)
def test_default_run_learns_the_demo_preference(demo_run):
    out, metrics = demo_run
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    evals = [entry for entry in history if "eval_rewards/accuracies" in entry]
    assert evals[0]["step"] == 0 and evals[0]["eval_loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert evals[0]["eval_rewards/accuracies"] < 0.5
    assert metrics["eval_rewards/accuracies"] >= 0.9
    assert metrics["eval_loss"] < math.log(2) - 0.1


@pytest.mark.slow  # reads the module's demo run (~40 s on 2 cores)
def test_default_run_writes_checkpoints_identity_and_curves(demo_run):
    out, _ = demo_run
    for step in (40, 80):
        checkpoint = out / f"checkpoint-{step}"
        identity = json.loads((checkpoint / "pair_dpo_reference.json").read_text())
        assert identity["pinned"] is True and identity["revision"] == train.DEMO_REVISION
    assert (out / "training_curves.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow  # reads the module's demo run (~40 s on 2 cores)
def test_plot_cli_redraws_curves_from_trainer_state(demo_run, tmp_path):
    out, _ = demo_run
    (out / "training_curves.png").unlink()
    proc = subprocess.run(["pair-dpo", "plot", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (out / "training_curves.png").read_bytes()[:8] == PNG_MAGIC
    missing = subprocess.run(["pair-dpo", "plot", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "trainer_state.json" in missing.stderr


def test_the_config_sets_expandable_segments_only_when_no_allocator_is_configured(monkeypatch):
    """What every PairDPOConfig (train.py's and a library user's) applies, on a machine with CUDA: the variable
    before CUDA starts, the running allocator after, nothing when the user chose a setting."""
    import torch

    from pair_dpo_trainer.config import allocator

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    env: dict[str, str] = {}
    assert allocator.default_cuda_allocator(env) == "expandable_segments:True"
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    env = {}
    assert "pair_dpo default" in allocator.apply_allocator_default(env) and env["PYTORCH_CUDA_ALLOC_CONF"]
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        chosen = {name: "expandable_segments:False"}
        assert allocator.default_cuda_allocator(chosen) is None and chosen == {name: "expandable_segments:False"}
        assert allocator.apply_allocator_default(chosen) == f"{name}=expandable_segments:False (set before the run)"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # CUDA already started: reconfigure it
    settings: list[str] = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", settings.append, raising=False)
    env = {}
    assert "for new segments" in allocator.apply_allocator_default(env)
    assert env == {} and settings == ["expandable_segments:True"]


def test_a_library_config_applies_the_allocator_before_training_arguments_set_up_the_device(monkeypatch, tmp_path):
    from transformers import TrainingArguments

    from pair_dpo_trainer.config import arguments

    calls = []
    monkeypatch.setattr(arguments, "apply_allocator_default", lambda: calls.append("allocator") or "chosen")
    real = TrainingArguments.__post_init__
    monkeypatch.setattr(TrainingArguments, "__post_init__", lambda self: calls.append("device") or real(self))
    config = arguments.PairDPOConfig(output_dir=str(tmp_path), report_to="none")
    assert calls == ["allocator", "device"] and config.allocator == "chosen"


def test_plot_cli_says_what_it_wrote(tmp_path, capsys):
    from pair_dpo_trainer.cli import main as cli_main

    history = [
        {"step": s, "loss": 0.7 - 0.1 * s, "rewards/margins": 0.1 * s, "rewards/accuracies": 0.5} for s in (1, 2)
    ]
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    assert cli_main(["plot", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"pair-dpo plot: wrote {tmp_path / 'training_curves.png'} (") and out.endswith("\n")
    assert str(tmp_path / "trainer_state.json") in out


def test_the_readme_quick_start_is_the_one_process_command_that_keeps_the_preemption_promise():
    """The quick start starts the demo as guide section 12 says one process keeps SIGTERM's promise (checkpoint, exit
    75 to the scheduler); accelerate's one-process launcher warns against itself and SIGKILLs the run 5 s later."""
    readme = (ROOT / "README.md").read_text()
    quick_start = readme.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("\n```", 1)[0]
    assert quick_start.split(" && ")[-1] == "python train.py"
    guide = (ROOT / "docs" / "guide.md").read_text().split("## 12. Failures and recovery", 1)[1]
    row = next(line for line in guide.splitlines() if line.startswith("| `python train.py` (one process"))
    assert row.endswith("| **75** |")


def test_nearly_flat_curves_are_labelled_with_their_values_not_an_offset():
    from pair_dpo_trainer.cli.plot import curves_figure

    history = [  # a loss at ln 2 that moves in its sixth decimal, as the first steps of a run do
        {"step": s, "loss": 0.693147 - 3e-6 * s, "rewards/margins": 1e-5 * s, "rewards/accuracies": 0.5}
        for s in range(1, 6)
    ]
    fig = curves_figure(history)
    fig.canvas.draw()
    loss_axis = fig.axes[0]
    offsets = [ax.yaxis.get_offset_text().get_text() for ax in fig.axes]
    assert offsets[0] == "" and not any("+" in text for text in offsets)  # a scale (1e-5) may stay, never an offset
    assert any(label.get_text().startswith("0.6931") for label in loss_axis.get_yticklabels())


def test_a_small_file_trains_on_all_its_rows_and_a_run_without_evaluation_prints_no_empty_metrics(tmp_path, capsys):
    from pair_dpo_trainer.demo import bundled_model_dir, bundled_pairs_path

    pairs = tmp_path / "small.jsonl"  # 150 pairs: 5% is under 16, so --eval_size auto holds out none
    pairs.write_text("".join(bundled_pairs_path().read_text(encoding="utf-8").splitlines(True)[:150]))
    argv = ["--model_name_or_path", str(bundled_model_dir()), "--dataset", str(pairs), "--max_steps", "1"]
    argv += ["--output_dir", str(tmp_path / "out"), "--use_cpu", "true", "--disable_tqdm", "true"]
    argv += ["--report_to", "none", "--max_length", "64", "--save_strategy", "no"]
    metrics = train.main(argv)
    out = capsys.readouterr().out.splitlines()
    assert metrics == {} and "{}" not in out
    assert f"train.py: {pairs}: 150 rows: 150 for training, none held out" in out[0]
    assert any("train: chat template (150 conversations)" in line for line in out)
