"""One ``accelerate launch`` of a 2-process test worker on the CPU, shared by the distributed test modules."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.timing import scaled

ROOT = Path(__file__).resolve().parents[1]


def accelerate_launch(config: Path, worker: str, out: Path, *, env: dict[str, str] | None = None, timeout: int = 600):
    """Runs ``accelerate launch --config_file config tests/<worker> out`` from the repository root (CPU only, one
    thread per process, this checkout on ``PYTHONPATH``) and asserts exit code 0, showing the output's tail if not."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    return _launch(cmd, worker, out, env=env, timeout=timeout)


def torchrun(
    worker: str,
    out: Path,
    *,
    port: int,
    env: dict[str, str] | None = None,
    timeout: int = 600,
    nproc: int = 2,
    args: tuple[str, ...] = (),
):
    """The same with ``torchrun --nproc_per_node nproc --master_port port`` (no accelerate config); ``args`` follow
    ``out`` on the worker's command line."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(port)]
    return _launch(cmd, worker, out, env=env, timeout=timeout, args=args)


def _launch(
    cmd: list[str], worker: str, out: Path, *, env: dict[str, str] | None, timeout: int, args: tuple[str, ...] = ()
):
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": str(ROOT),
        **(env or {}),
    }
    proc = subprocess.run(
        [*cmd, str(ROOT / "tests" / worker), str(out), *args],
        env=full_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(timeout),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return proc
