"""One ``accelerate launch`` of a 2-process test worker on the CPU, shared by the distributed test modules."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def accelerate_launch(config: Path, worker: str, out: Path, *, env: dict[str, str] | None = None, timeout: int = 600):
    """Runs ``accelerate launch --config_file config tests/<worker> out`` from the repository root (CPU only, one
    thread per process, this checkout on ``PYTHONPATH``) and asserts exit code 0, showing the output's tail if not."""
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": str(ROOT),
        **(env or {}),
    }
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    proc = subprocess.run(
        [*cmd, str(ROOT / "tests" / worker), str(out)],
        env=full_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return proc
