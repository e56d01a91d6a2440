"""FSDP2 (``torch.distributed.fsdp.fully_shard`` through Accelerate) with 2 real processes on the CPU (gloo), not mocked.

One launch runs every phase (see tests/fsdp_worker.py); the single-process DP=1 runs without FSDP run here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.ports import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    """Runs tests/fsdp_worker.py once on 2 ranks; returns the rank-0 results."""
    out = tmp_path_factory.mktemp("fsdp2")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    start = time.monotonic()
    proc = subprocess.run(
        [*cmd, str(ROOT / "tests" / "fsdp_worker.py"), str(out)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    results = torch.load(out / "results.pt", weights_only=False)
    print(f"\nFSDP2 launch: {time.monotonic() - start:.1f} s")
    return results


def test_fsdp_training_arguments_shard_the_policy_instead_of_training_ddp(fsdp2):
    """``fsdp="full_shard"`` + ``fsdp_config={"fsdp_version": 2}`` on two CPU processes used to train as plain DDP
    (Accelerate drops its FSDP plugin on the CPU) and exit 0: every parameter must be a DTensor holding a slice."""
    run = fsdp2["args_fsdp"]
    policy = run["policy"]
    assert run["wrapped"] != "DistributedDataParallel"
    assert policy["count"] > 0 and policy["dtensor"] == policy["count"], policy
    assert policy["sliced"] == policy["count"], policy
