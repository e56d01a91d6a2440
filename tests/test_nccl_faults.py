"""NCCL versions of the CPU fault tests (tests/test_run_faults.py), on 2 GPUs (marked ``gpu``: skipped without two).

Cases (tests/fault_worker.py, ranks launched directly with RANK / WORLD_SIZE, one GPU each, ddp_timeout=30 s):
  stall_backward: rank 1 SIGSTOPs after its last forward of step 4; rank 0 waits in DDP's NCCL gradient all-reduce.
      Default error handling: NCCL's watchdog must end rank 0 within ~30 s (+ its own grace), printing
      "Watchdog caught collective operation timeout ... Timeout(ms)=30000".
  stall_backward_blocking: the same with TORCH_NCCL_BLOCKING_WAIT=1: rank 0 raises collective_timeout (our message).
  stall_step_end: rank 1 SIGSTOPs at the end of step 3: rank 0 waits in the preemption agreement (gloo CPU group):
      collective_timeout naming all_reduce within ~30 s.
  sigterm_one_rank: SIGTERM to rank 1 only: both ranks exit 75 after the same step with a complete checkpoint.
Each case also appends its JSON line to ``$OUT/nccl_faults.jsonl`` when ``OUT`` is set (the GPU machine's results).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from pair_dpo_trainer.fault_tolerance.checkpoint import checkpoint_problem, list_checkpoints
from tests.faults import (
    kill_all,
    launch,
    logs,
    outcome,
    run_spec,
    signal_rank_after,
    wait,
    wait_for_progress,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

TIMEOUT = 30


def stall(root: Path, name: str, where: str, extra_env: dict[str, str] | None = None) -> dict:
    spec = run_spec(root, name, max_steps=40, save_steps=1000, ddp_timeout=TIMEOUT, gpu=True)
    spec["fault"] = {"kind": "stop", "where": where, "step": 3, "rank": 1}
    procs = launch([spec], root / name, world_size=2, extra_env=extra_env)
    try:
        wait_for_progress(spec, 1, 2, procs, timeout=300)
        start = time.time()
        code = wait(procs[:1], TIMEOUT + 120)[0]
        elapsed = round(time.time() - start, 1)
    finally:
        kill_all(procs)
    text = logs(root / name)
    result_file = Path(f"{spec['result']}.rank0.json")
    result = json.loads(result_file.read_text()) if result_file.exists() else {}
    watchdog = "Watchdog caught collective operation timeout" in text
    ok = code not in (None, 0) and elapsed < TIMEOUT + 90
    ok = ok and (watchdog or result.get("reason_code") == "collective_timeout")
    return {
        "case": name,
        "ok": ok,
        "rank0_exit": code,
        "rank0_exit_after_s": elapsed,
        "reason_code": result.get("reason_code"),
        "message": (result.get("message") or "")[:300],
        "watchdog_message": watchdog,
    }


def sigterm(root: Path) -> dict:
    spec = run_spec(root, "sigterm", max_steps=40, save_steps=1000, step_sleep=0.3, ddp_timeout=TIMEOUT, gpu=True)
    codes = signal_rank_after(spec, launch([spec], root / "sigterm", world_size=2), 1, 2, signal.SIGTERM, timeout=300)
    visible = list_checkpoints(spec["out"])
    complete = bool(visible) and all(checkpoint_problem(p) is None for _, p in visible)
    reasons = [outcome(spec, r).get("reason_code") for r in (0, 1)]
    return {
        "case": "sigterm_one_rank",
        "ok": codes == [75, 75] and complete,
        "exit_codes": codes,
        "checkpoints": [s for s, _ in visible],
        "reasons": reasons,
    }


def _record(result: dict) -> dict:
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "nccl_faults.jsonl"), "a") as handle:
            handle.write(json.dumps(result) + "\n")
    return result


@pytest.mark.parametrize(
    "name,where,env",
    [
        ("stall_backward", "backward", None),
        ("stall_backward_blocking", "backward", {"TORCH_NCCL_BLOCKING_WAIT": "1"}),
        ("stall_step_end", "step_end", None),
    ],
)
def test_a_stalled_rank_ends_the_job_within_the_collective_timeout(tmp_path, name, where, env):
    result = _record(stall(tmp_path, name, where, env))
    assert result["ok"], result


def test_sigterm_to_one_rank_saves_one_complete_checkpoint_and_exits_75_on_both(tmp_path):
    result = _record(sigterm(tmp_path))
    assert result["ok"], result
