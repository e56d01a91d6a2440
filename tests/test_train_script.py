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


@pytest.mark.integration
def test_sigterm_while_train_py_reads_its_options_exits_75(tmp_path):
    """The stop-signal handler is train.py's first step: a real SIGTERM while it reads its config file (a FIFO, so
    the read waits at a known point inside the argument parsing) ends it with 75 and its ``[preempted]`` line, not
    with the signal's default death (-15)."""
    import os
    import signal

    fifo = tmp_path / "run.yaml"
    os.mkfifo(fifo)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), str(fifo)], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        with open(fifo, "w"):  # returns once train.py opened the file to read it: it waits in the read now
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=60)
    finally:
        proc.kill()
    stderr = proc.stderr.read() if proc.stderr else ""
    assert code == 75, (code, stderr[-2000:])
    assert "[preempted] SIGTERM" in stderr


@pytest.mark.slow
def test_the_preemption_marker_stays_until_a_run_starts_training(tmp_path):
    """``pair_dpo_preempted.json`` is a requeue script's only sign of a preemption under torchrun: a launch that fails
    before training (a missing model directory; a refused resume, after the output-dir lock is taken) keeps it, a
    run that starts training removes it."""
    from pair_dpo_trainer.demo import bundled_model_dir, bundled_pairs_path
    from pair_dpo_trainer.errors import PairDPOError
    from pair_dpo_trainer.fault_tolerance.preemption import PREEMPTED_MARKER

    out = tmp_path / "out"
    out.mkdir()
    marker = out / PREEMPTED_MARKER
    marker.write_text('{"exit_code": 75, "phase": "training"}\n')
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(bundled_pairs_path().read_text().splitlines(keepends=True)[:24]))
    flags = ["--dataset", str(pairs), "--eval_size", "0", "--max_steps", "1"]
    flags += ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--max_length", "64"]
    flags += ["--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true", "--output_dir", str(out)]
    flags += ["--model_name_or_path"]
    with pytest.raises(PairDPOError) as missing:
        train.main([*flags, str(tmp_path / "no-model")])
    assert missing.value.reason_code == "model_not_found" and marker.exists()
    with pytest.raises(PairDPOError) as refused:
        train.main([*flags, str(bundled_model_dir()), "--resume_from_checkpoint", str(out / "checkpoint-7")])
    assert refused.value.reason_code == "no_checkpoint" and marker.exists()
    train.main([*flags, str(bundled_model_dir())])
    assert not marker.exists()


def test_remote_tokenizer_code_added_after_pinning_is_refused_before_anything_loads(tmp_path):
    """A pinned snapshot whose tokenizer_config.json gained an ``auto_map`` to a Python file after pinning: train.py
    verifies the snapshot before it loads the tokenizer (the unpinned file refused, its code never imported),
    and the package never lets transformers run or ask about remote code (``trust_remote_code=False``)."""
    import shutil

    from pair_dpo_trainer.demo import DEMO_REVISION, bundled_model_dir, bundled_pairs_path
    from pair_dpo_trainer.errors import SnapshotIntegrityError
    from pair_dpo_trainer.trainer import PairDPOTrainer
    from tests.dpo_fixtures import cpu_config

    model = tmp_path / "model"
    shutil.copytree(bundled_model_dir(), model)
    imported = tmp_path / "remote_code_ran"
    (model / "evil_tokenizer.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(imported)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": [None, "evil_tokenizer.EvilTokenizer"]})
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(bundled_pairs_path().read_text().splitlines(keepends=True)[:16]))
    flags = ["--model_name_or_path", str(model), "--dataset", str(pairs), "--eval_size", "0", "--max_steps", "1"]
    flags += ["--ref_model_revision", DEMO_REVISION, "--report_to", "none", "--output_dir", str(tmp_path / "out")]
    with pytest.raises(SnapshotIntegrityError) as changed:
        train.main(flags)
    assert changed.value.reason_code == "metadata_missing" and changed.value.path == "evil_tokenizer.py"
    args = cpu_config(tmp_path, loss_type="simpo", per_device_train_batch_size=1, gradient_accumulation_steps=1)
    with pytest.raises(ValueError, match="trust_remote_code"):  # unpinned: transformers refuses, never prompts
        PairDPOTrainer(model=str(model), args=args, train_dataset=[{"prompt": "a", "chosen": "b", "rejected": "c"}])
    assert not imported.exists()


def _pre_tokenised_lines(*bad) -> str:
    """24 pre-tokenised pairs (6 prompts) within the bundled model's vocabulary; ``bad`` (given) replaces an id of row
    5."""
    rows = [
        {
            "prompt_input_ids": [1, 10 + i % 6, 11],
            "chosen_input_ids": [20 + i % 9, 30, 2],
            "rejected_input_ids": [40, 2],
        }
        for i in range(24)
    ]
    if bad:
        rows[5]["chosen_input_ids"][1] = bad[0]
    return "".join(json.dumps(row) + "\n" for row in rows)  # NaN is written as JSON's common extension NaN


@pytest.mark.slow
def test_a_pre_tokenised_jsonl_file_trains_through_train_py_and_a_non_whole_id_is_bad_token_id(tmp_path):
    """The guide's pre-tokenised rows as a file: train.py splits them by their prompt ids and trains; an id of 1.5
    (which batching would cut to 1) or NaN (a raw Arrow error in the conversion) is ``bad_token_id`` naming the row."""
    from pair_dpo_trainer.data.dataset import as_pair_dataset
    from pair_dpo_trainer.demo import bundled_model_dir
    from pair_dpo_trainer.errors import ConfigError
    from tests.models import tiny_tokenizer

    flags = ["--model_name_or_path", str(bundled_model_dir()), "--max_steps", "1", "--save_strategy", "no"]
    flags += ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--report_to", "none"]
    flags += ["--disable_tqdm", "true", "--eval_strategy", "no", "--dataset_cache_dir", str(tmp_path / "cache")]
    good = tmp_path / "pairs.jsonl"
    good.write_text(_pre_tokenised_lines())
    metrics = train.main([*flags, "--dataset", str(good), "--eval_size", "4", "--output_dir", str(tmp_path / "ok")])
    assert math.isfinite(metrics["eval_loss"])  # 4 rows of one prompt held out, the others trained on
    for bad in (1.5, float("nan")):
        path = tmp_path / "bad.jsonl"
        path.write_text(_pre_tokenised_lines(bad))
        with pytest.raises(ConfigError) as info:
            train.main([*flags, "--dataset", str(path), "--eval_size", "0", "--output_dir", str(tmp_path / "bad")])
        assert info.value.reason_code == "bad_token_id", info.value
        assert f"train dataset row 5: chosen_input_ids holds {bad!r}, not a token id" in info.value.message
    for bad in (None, "30", True):  # in memory: the same check, no model needed
        rows = [json.loads(line) for line in _pre_tokenised_lines(bad).splitlines()]
        with pytest.raises(ConfigError, match="row 5: chosen_input_ids holds"):
            as_pair_dataset(rows, tiny_tokenizer(), max_length=64, max_prompt_length=32, max_tokens_per_microbatch=None)


def test_a_file_of_one_prompt_says_the_eval_split_took_it(tmp_path):
    """200 copies of one pair: the eval split takes the one prompt group (train and eval never share a prompt), and
    the refusal says so instead of "the dataset has 0 rows"."""
    from pair_dpo_trainer.demo import bundled_model_dir, bundled_pairs_path
    from pair_dpo_trainer.errors import ScheduleError

    path = tmp_path / "same.jsonl"
    path.write_text(bundled_pairs_path().read_text().splitlines(keepends=True)[0] * 200)
    with pytest.raises(ScheduleError) as refused:
        train.main(
            [
                "--model_name_or_path",
                str(bundled_model_dir()),
                "--dataset",
                str(path),
                "--output_dir",
                str(tmp_path / "out"),
                "--eval_size",
                "200",
            ]
        )
    assert refused.value.reason_code == "too_few_pairs"
    assert "the eval split (eval_size=200) took the only prompt group" in refused.value.message
    assert "--eval_size 0" in refused.value.message
