"""Multi-process test workers on the CPU, shared by the distributed test modules: through a real launcher
(``accelerate launch``, ``torchrun``) where the launch is part of what a test checks, or as ranks forked by the fork
server (``ranks``) where only the ranks' results are."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.faults import fork, wait_or_kill, worker_env
from tests.ports import free_port
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


def ranks(worker: str, out: Path, *, nproc: int = 2, args: tuple[str, ...] = (), timeout: int = 600) -> str:
    """Runs ``tests/<worker> out args...`` as ``nproc`` ranks with the variables a launcher sets (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, ...), each forked by the fork server (no launcher, no imports
    paid per rank); asserts that every rank exits 0, showing the logs if not, and returns the logs (rank order)."""
    port = free_port()
    logs = [out / f"rank{rank}.log" for rank in range(nproc)]
    argv = [str(out), *args]
    procs = [fork(ROOT / "tests" / worker, argv, worker_env(rank, nproc, port), logs[rank]) for rank in range(nproc)]
    codes = wait_or_kill(procs, timeout)
    text = "\n".join(f"--- rank {rank}\n{log.read_text()}" for rank, log in enumerate(logs))
    assert codes == [0] * nproc, f"exit codes {codes}\n{text[-12000:]}"
    return text
