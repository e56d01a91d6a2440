"""A diverging run and an explicit resume of an older step: real training runs of the tiny Llama, real checkpoints.

- A learning rate of 1e8 makes step 2's loss finite and its gradient norm NaN (the weights of step 1 are huge but
  finite): that step and the next are never applied, counted, and the run stops with ``nonfinite_gradients``.
- A learning rate of 1e39 overflows the AdamW update with a finite gradient norm: the weights become NaN/inf and the
  checkpoint of them is refused (``nonfinite_weights``); the last good checkpoint stays ``latest``.
- Resuming checkpoint-4 of a run that reached checkpoint-6 moves 6 aside, so ``auto`` follows the resumed line.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pair_dpo_trainer.errors import CheckpointError, RunError
from pair_dpo_trainer.fault_tolerance.checkpoint import checkpoint_problem, list_checkpoints, read_manifest
from pair_dpo_trainer.fault_tolerance.resume import latest_complete_checkpoint
from tests.fault_worker import build
from tests.faults import assert_same_parameters, logs, outcome, run_spec, run_to_end

BLOW_UP = 1e8  # step 1 applies a huge finite update; from step 2 on the loss is finite and the gradient norm NaN
OVERFLOW = 1e39  # the AdamW update itself overflows float32 although the gradient norm is finite


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "model.safetensors"))


def _all_finite(weights: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(value).all()) for value in weights.values())


def _logged(trainer, key: str) -> dict[int, float]:
    return {e["step"]: e[key] for e in trainer.state.log_history if "loss" in e and key in e}


def test_steps_with_a_nan_gradient_norm_are_not_applied_and_the_run_stops_after_the_limit(tmp_path, caplog):
    """The default limit (10 skips): steps 2..11 are skipped, step 12 stops the run; every checkpoint holds the
    weights of step 1 (the last applied step) and the count; ``latest`` resumes both, so a requeue stops at once."""
    steps = 12
    spec = run_spec(tmp_path, "run", max_steps=steps, save_steps=1, save_total_limit=1, learning_rate=BLOW_UP)
    trainer = build(spec)
    with caplog.at_level(logging.WARNING), pytest.raises(RunError) as stopped:
        trainer.train()
    assert stopped.value.reason_code == "nonfinite_gradients" and "max_nonfinite_grad_skips=10" in str(stopped.value)
    assert f"step {steps}:" in str(stopped.value) and "step 2: the gradient norm is nan" in caplog.text
    norms, losses = _logged(trainer, "grad_norm"), _logged(trainer, "loss")
    assert all(norms[k] != norms[k] for k in range(2, steps)) and all(abs(losses[k]) < 10 for k in losses)
    assert _logged(trainer, "nonfinite_grad_skips") == {k: k - 1 for k in range(2, steps)}  # logged from the first skip
    # the learning-rate schedule advanced on every skipped step: linear decay over max_steps, read before the step
    learning_rates = _logged(trainer, "learning_rate")
    assert learning_rates == pytest.approx({k: BLOW_UP * (steps - k + 1) / steps for k in range(1, steps)})

    out = Path(spec["out"])
    latest = Path(latest_complete_checkpoint(out))
    assert latest == out / f"checkpoint-{steps - 1}" and [s for s, _ in list_checkpoints(out)] == [steps - 1]
    assert read_manifest(latest)["weights_finite"] is True
    one_step = build(run_spec(tmp_path, "one_step", max_steps=1, save_steps=100, learning_rate=BLOW_UP))
    one_step.train()  # step 1 alone: its learning rate is the 12-step run's at step 1
    step_one = {name: p.detach() for name, p in one_step.model.named_parameters()}
    saved = _weights(latest)
    assert _all_finite(saved)
    assert_same_parameters(step_one, {name: saved[name] for name in step_one}, atol=0)
    optimizer_state = torch.load(latest / "optimizer.pt", weights_only=True)["state"]
    assert {float(state["step"]) for state in optimizer_state.values()} == {1.0}  # one AdamW step, then none

    assert read_manifest(latest)["nonfinite_grad_skips"] == 10
    requeued = build({**spec, "max_steps": steps + 2})  # resumes finite weights and the run's count: stops at once
    with pytest.raises(RunError) as again:
        requeued.train(resume_from_checkpoint="latest")
    assert requeued.run_guard.resume_checkpoint == str(latest) and again.value.reason_code == "nonfinite_gradients"
    assert f"step {steps}:" in str(again.value) and "number 11" in str(again.value)
    assert all(bool(torch.isfinite(p).all()) for p in requeued.model.parameters())


def test_a_checkpoint_of_non_finite_weights_is_refused_and_the_last_good_one_stays_latest(tmp_path):
    spec = run_spec(tmp_path, "run", max_steps=2, save_steps=1, save_total_limit=1)
    build(spec).train()
    out = Path(spec["out"])
    good = _weights(out / "checkpoint-2")
    overflowing = build({**spec, "max_steps": 4, "learning_rate": OVERFLOW})
    with pytest.raises(CheckpointError) as refused:
        overflowing.train(resume_from_checkpoint="latest")
    assert refused.value.reason_code == "nonfinite_weights" and "checkpoint-3 was not saved" in str(refused.value)
    assert not all(bool(torch.isfinite(p).all()) for p in overflowing.model.parameters())  # the fault was real
    assert [step for step, _ in list_checkpoints(out)] == [2]
    assert latest_complete_checkpoint(out) == str(out / "checkpoint-2")
    assert checkpoint_problem(out / "checkpoint-2") is None
    assert_same_parameters(good, _weights(out / "checkpoint-2"), atol=0)


def test_an_explicit_resume_of_an_older_step_moves_the_newer_checkpoints_aside_and_auto_follows_it(tmp_path, caplog):
    first = run_spec(tmp_path, "run", max_steps=6, save_steps=2, save_total_limit=2)
    build(first).train()
    out = Path(first["out"])
    assert [step for step, _ in list_checkpoints(out)] == [4, 6]
    abandoned_weights = _weights(out / "checkpoint-6")
    line = {**first, "save_steps": 1, "learning_rate": 5e-3}  # the resumed line trains differently from the first
    with caplog.at_level(logging.WARNING):
        resumed = build({**line, "max_steps": 5})
        resumed.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert [step for step, _ in list_checkpoints(out)] == [4, 5]
    (aside,) = [path for path in out.iterdir() if path.name.startswith("abandoned-checkpoint-6-")]
    assert f"checkpoint-6 -> {aside.name}" in caplog.text
    assert checkpoint_problem(aside) is None and resumed.run_guard.abandoned == [aside]
    assert_same_parameters(abandoned_weights, _weights(aside), atol=0)  # moved aside, not changed

    requeued = build({**line, "max_steps": 6})
    requeued.train(resume_from_checkpoint="auto")
    assert requeued.run_guard.resume_checkpoint == str(out / "checkpoint-5") and requeued.state.global_step == 6
    assert [step for step, _ in list_checkpoints(out)] == [5, 6] and aside.is_dir()
    new_six = _weights(out / "checkpoint-6")
    assert any(not torch.equal(new_six[name], abandoned_weights[name]) for name in new_six)


def _logged_learning_rates(checkpoint: Path) -> dict[int, float]:
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return {e["step"]: e["learning_rate"] for e in state["log_history"] if "learning_rate" in e}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["ddp", "zero3"])
def test_two_ranks_skip_the_same_non_finite_steps_and_stop_together(tmp_path, layout):
    """DDP: the gradients are all-reduced before the norm; ZeRO-3: DeepSpeed's optimizer discards the step whose
    global norm is invalid and the skip is counted. Either way both ranks skip steps 2 and 3, keep the learning-rate
    schedule going, and stop at step 4 with the same reason; the skip counts agree at each save, and the published
    checkpoint is finite."""
    deepspeed = {}
    if layout == "zero3":
        pytest.importorskip("deepspeed")
        from tests.test_deepspeed import DS_CONFIG

        deepspeed = {"deepspeed": DS_CONFIG}
    steps = 8
    spec = run_spec(
        tmp_path, "run", max_steps=steps, save_steps=1, save_total_limit=1, learning_rate=BLOW_UP,
        max_nonfinite_grad_skips=2, ddp_timeout=120, **deepspeed,
    )  # fmt: skip
    codes = run_to_end([spec], tmp_path / "run", world_size=2, timeout=400)
    assert codes == [1, 1], logs(tmp_path / "run")
    for rank in (0, 1):
        result = outcome(spec, rank)
        assert result["reason_code"] == "nonfinite_gradients" and "step 4:" in result["message"], result
    out = Path(spec["out"])
    assert [step for step, _ in list_checkpoints(out)] == [3]
    manifest = read_manifest(out / "checkpoint-3")
    assert manifest["weights_finite"] is True and manifest["nonfinite_grad_skips"] == 2
    assert _logged_learning_rates(out / "checkpoint-3") == pytest.approx(
        {k: BLOW_UP * (steps - k + 1) / steps for k in (1, 2, 3)}
    )
    if layout == "ddp":  # ZeRO-3 checkpoints hold the partitions under global_step*/, not model.safetensors
        assert _all_finite(_weights(out / "checkpoint-3"))
