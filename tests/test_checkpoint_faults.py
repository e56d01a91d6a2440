"""Interrupted saves, a full disk, and resume: real signals in real processes, a real (small) tmpfs.

Each faulty run is tests/fault_worker.py in a subprocess that sends itself SIGKILL or SIGINT (Ctrl-C) at a point inside
a checkpoint save; the resume then runs here and must pick the newest *complete* checkpoint and continue exactly like
an uninterrupted run.
"""

from __future__ import annotations

import logging
import math
import subprocess
from pathlib import Path

import pytest

from pair_dpo_trainer.errors import CheckpointError
from pair_dpo_trainer.fault_tolerance.checkpoint import (
    STAGING_DIRNAME,
    checkpoint_problem,
    list_checkpoints,
    read_manifest,
)
from tests.ds_worker import full_parameters
from tests.fault_worker import build
from tests.faults import assert_same_parameters, final_state, logs, outcome, run_spec, run_to_end

STEPS = 8


def _train_in_process(spec: dict) -> tuple:
    trainer = build(spec)
    trainer.train(resume_from_checkpoint=spec.get("resume"))
    return trainer, full_parameters(trainer.model)


def _losses_after(trainer, step: int) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e and e["step"] > step]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference runs (8 steps, with and without a reference model) in this process."""
    root = tmp_path_factory.mktemp("straight")
    runs = {}
    for free in (False, True):
        trainer, params = _train_in_process(run_spec(root, f"free{free}", max_steps=STEPS, reference_free=free))
        runs[free] = (trainer, params)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize(
    ("point", "signal", "free", "resumed_step"),
    [
        ("optimizer", "KILL", False, 4),  # optimizer.pt half written
        ("identity", "KILL", False, 4),  # everything but the reference identity written
        ("rotation", "KILL", False, 6),  # the new checkpoint done, an old one half deleted
        ("optimizer", "INT", False, 4),  # Ctrl-C while optimizer.pt is written
        ("optimizer", "KILL", True, 4),  # reference_free: the same guarantees without an identity file
    ],
)
@pytest.mark.integration
def test_a_save_interrupted_by_a_signal_leaves_only_complete_checkpoints_and_resume_latest_continues_exactly(
    tmp_path, uninterrupted, caplog, point, signal, free, resumed_step
):
    fault = {"kind": "save", "point": point, "signal": signal, "step": 6}
    spec = run_spec(tmp_path, "run", max_steps=STEPS, save_total_limit=2, reference_free=free, fault=fault)
    (code,) = run_to_end([spec], tmp_path)
    assert code in (-9, -2), logs(tmp_path)  # killed by SIGKILL, or by SIGINT (an uncaught KeyboardInterrupt)
    out = Path(spec["out"])
    visible = list_checkpoints(out)
    assert visible and all(checkpoint_problem(path) is None for _, path in visible), [
        (path.name, checkpoint_problem(path)) for _, path in visible
    ]
    assert max(step for step, _ in visible) == resumed_step
    with caplog.at_level(logging.WARNING):
        trainer, params = _train_in_process({**spec, "fault": None, "resume": True})
    assert trainer.run_guard.resume_checkpoint == str(out / f"checkpoint-{resumed_step}")
    if resumed_step == 4:  # the interrupted save of step 6 is named as ignored
        assert f"{STAGING_DIRNAME}/checkpoint-6" in caplog.text
    straight, straight_params = uninterrupted[free]
    assert _losses_after(trainer, resumed_step) == pytest.approx(_losses_after(straight, resumed_step), abs=1e-6)
    assert_same_parameters(straight_params, params)
    assert not (out / STAGING_DIRNAME).exists()


@pytest.mark.integration
def test_resume_latest_skips_a_checkpoint_with_a_truncated_file_and_refuses_it_by_path(tmp_path, caplog):
    spec = run_spec(tmp_path, "run", max_steps=4)
    _train_in_process(spec)
    out = Path(spec["out"])
    broken = out / "checkpoint-4"
    (broken / "optimizer.pt").write_bytes(b"")
    with caplog.at_level(logging.WARNING):
        trainer = build({**spec, "max_steps": 6})
        with pytest.raises(CheckpointError) as refused:
            trainer.train(resume_from_checkpoint=str(broken))
    assert refused.value.reason_code == "checkpoint_incomplete" and "optimizer.pt" in str(refused.value)
    trainer.train(resume_from_checkpoint="latest")
    assert trainer.run_guard.resume_checkpoint == str(out / "checkpoint-2")
    assert f"skipping incomplete checkpoint {broken}" in caplog.text and "optimizer.pt has 0 bytes" in caplog.text
    assert trainer.state.global_step == 6


def test_resuming_the_checkpoint_of_the_last_step_trains_no_further_step(tmp_path):
    """A run whose final evaluation or save was interrupted is redone from its last step's checkpoint: the Trainer
    alone would train one step more (its epoch loop checks ``max_steps`` only after a step)."""
    spec = run_spec(tmp_path, "run", max_steps=4)
    _, params = _train_in_process(spec)
    resumed, resumed_params = _train_in_process({**spec, "resume": "latest"})
    assert resumed.run_guard.resume_checkpoint == str(Path(spec["out"]) / "checkpoint-4")
    assert resumed.state.global_step == 4 and _losses_after(resumed, 4) == []
    assert_same_parameters(params, resumed_params)


def test_resume_latest_with_no_complete_checkpoint_refuses_and_auto_starts_fresh(tmp_path):
    spec = run_spec(tmp_path, "run", max_steps=2, save_steps=10)
    trainer = build(spec)
    with pytest.raises(CheckpointError) as refused:
        trainer.train(resume_from_checkpoint=True)
    assert refused.value.reason_code == "no_checkpoint" and spec["out"] in str(refused.value)
    trainer.train(resume_from_checkpoint="auto")
    assert trainer.run_guard.resume_checkpoint is None and trainer.state.global_step == 2


@pytest.mark.parametrize(
    ("change", "options"),
    [("dataset", {"num_pairs": 56}), ("lengths", {"data_seed": 3}), ("seed", {"seed": 1}), ("layout", {"ga": 4})],
)
@pytest.mark.integration
def test_resuming_with_another_schedule_refuses_unless_explicitly_accepted(tmp_path, caplog, change, options):
    spec = run_spec(tmp_path, "run", max_steps=2)
    _train_in_process(spec)
    other = {**spec, "max_steps": 4, "resume": "latest", **options}
    with pytest.raises(CheckpointError) as refused:
        _train_in_process(other)
    assert refused.value.reason_code == "resume_data_mismatch", change
    assert "allow_resume_data_mismatch" in str(refused.value)
    with caplog.at_level(logging.WARNING):
        trainer = build(other)
        trainer.args.allow_resume_data_mismatch = True
        trainer.train(resume_from_checkpoint="latest")
    assert trainer.state.global_step == 4 and "Continuing as allow_resume_data_mismatch=True asks" in caplog.text


def test_the_same_schedule_resumes_without_a_data_warning(tmp_path, caplog):
    spec = run_spec(tmp_path, "run", max_steps=2)
    _train_in_process(spec)
    with caplog.at_level(logging.WARNING):
        trainer, _ = _train_in_process({**spec, "max_steps": 4, "resume": "latest"})
    assert trainer.state.global_step == 4 and "fingerprint" not in caplog.text


# ---------------------------------------------------------------------------------------------- full disk (tmpfs)
@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 2 MiB tmpfs (needs root and mount(2)); skipped where this machine cannot mount one."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.mark.parametrize("free_bytes", [40_000, 150_000])  # cut in model.safetensors / in optimizer.pt (torch.save)
def test_a_full_disk_during_a_save_raises_disk_full_and_leaves_no_partial_checkpoint(small_tmpfs, free_bytes):
    spec = {
        **run_spec(small_tmpfs, "run", max_steps=6),
        "fault": {"kind": "fill_disk", "step": 3, "free": free_bytes},
    }
    trainer = build(spec)
    with pytest.raises(CheckpointError) as full:
        trainer.train()
    error = full.value
    out = Path(spec["out"])
    assert error.reason_code == "disk_full", error
    assert str(out) in str(error) and "free of 2.0 MiB" in str(error) and error.free_bytes < free_bytes
    assert [step for step, _ in list_checkpoints(out)] == [2]
    assert checkpoint_problem(out / "checkpoint-2") is None
    assert not (out / STAGING_DIRNAME).exists()  # neither the partial checkpoint nor an empty staging directory
    (out / "filler.bin").unlink()
    resumed = build({**spec, "fault": None})
    resumed.train(resume_from_checkpoint="latest")
    assert resumed.run_guard.resume_checkpoint == str(out / "checkpoint-2") and resumed.state.global_step == 6
    assert math.isfinite(resumed.state.log_history[-1]["train_loss"])


@pytest.mark.slow
@pytest.mark.distributed
def test_a_full_disk_on_the_main_rank_stops_every_rank_with_disk_full(tmp_path, small_tmpfs):
    spec = {
        **run_spec(tmp_path, "run", max_steps=6, ddp_timeout=30),  # logs and results off the full disk
        "out": str(small_tmpfs / "out"),
        "fault": {"kind": "fill_disk", "step": 3, "free": 150_000, "rank": 0},
    }
    logs_dir = tmp_path / "run"
    codes = run_to_end([spec], logs_dir, world_size=2, timeout=300)
    assert codes == [1, 1], logs(logs_dir)
    for rank in (0, 1):
        result = outcome(spec, rank)
        assert result["reason_code"] == "disk_full", result
        assert spec["out"] in result["message"]
    assert [step for step, _ in list_checkpoints(spec["out"])] == [2]


# ---------------------------------------------------------------------------------------------- DeepSpeed ZeRO-3
@pytest.mark.slow
@pytest.mark.distributed
def test_zero3_rank_killed_while_writing_its_shard_keeps_the_last_complete_checkpoint_and_resume_is_exact(tmp_path):
    pytest.importorskip("deepspeed")
    from tests.test_deepspeed import DS_CONFIG

    fault = {"kind": "save", "point": "shard", "signal": "KILL", "step": 4, "rank": 1}
    killed = run_spec(tmp_path, "killed", max_steps=6, deepspeed=DS_CONFIG, ddp_timeout=60, fault=fault)
    codes = run_to_end([killed], tmp_path / "killed", world_size=2)
    assert codes[1] == -9 and codes[0] not in (0, None), logs(tmp_path / "killed")
    visible = list_checkpoints(killed["out"])
    assert [step for step, _ in visible] == [2] and checkpoint_problem(visible[0][1]) is None
    shards = [name for name in read_manifest(visible[0][1])["files"] if "optim_states" in name]
    assert len(shards) == 2 and {"zero_pp_rank_0", "zero_pp_rank_1"} <= {n.split("/")[-1][:14] for n in shards}
    resumed = {**killed, "fault": None, "resume": "latest", "result": killed["result"] + "_resumed"}
    straight = run_spec(tmp_path, "straight", max_steps=6, deepspeed=DS_CONFIG)
    assert run_to_end([resumed, straight], tmp_path / "killed", world_size=2) == [0, 0], logs(tmp_path / "killed")
    after = [loss for step, loss in final_state(resumed)["losses"] if step > 2]
    assert after == pytest.approx([loss for step, loss in final_state(straight)["losses"] if step > 2], abs=1e-6)
    assert_same_parameters(final_state(straight)["params"], final_state(resumed)["params"], atol=1e-6)
