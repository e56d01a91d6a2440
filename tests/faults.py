"""Helpers for the fault tests: run tests/fault_worker.py as one process or as N directly launched ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tests.forkserver import ForkedProcess, ForkServer
from tests.ports import free_port
from tests.timing import scaled

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "fault_worker.py"


def run_spec(root: Path, name: str, **options: Any) -> dict[str, Any]:
    """A run spec for the worker with its files under ``root/name``."""
    base = root / name
    base.mkdir(parents=True, exist_ok=True)
    return {"out": str(base / "out"), "result": str(base / "result"), "progress": str(base / "progress"), **options}


def worker_env(rank: int = 0, world_size: int = 1, port: int | None = None, gpu: bool = False) -> dict[str, str]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        **({} if gpu else {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}),
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "TORCH_EXTENSIONS_DIR": os.environ.get(
            "TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "pair_dpo_torch_extensions")
        ),
    }
    if world_size > 1:
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    return env


def launch(
    runs: list[dict[str, Any]],
    log_dir: Path,
    world_size: int = 1,
    extra_env: dict[str, str] | None = None,
    *,
    session: bool = False,
) -> list[Any]:
    """Starts the worker once per rank (``RANK``/``WORLD_SIZE`` env as a launcher sets them); returns the processes
    (``subprocess.Popen`` or, forked by this pytest worker's fork server, ``ForkedProcess``: the same methods).

    ``session``: each in a session (and process group) of its own, as a shell job or a batch step, so that a test can
    signal the whole group (``os.killpg``) without signalling itself.
    """
    config = json.dumps({"runs": runs})
    port = free_port()
    gpu = any(run.get("gpu") for run in runs)
    procs: list[Any] = []
    for rank in range(world_size):
        env = {**worker_env(rank, world_size, port, gpu=gpu), **(extra_env or {})}
        if not forkable(env):
            log = open(log_dir / f"rank{rank}.log", "w")  # noqa: SIM115 - closed when the process is reaped
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), config],
                    env=env,
                    cwd=ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=session,
                )
            )
            continue
        procs.append(fork(WORKER, [config], env, log_dir / f"rank{rank}.log", session=session))
    return procs


_server: ForkServer | None = None


def fork(
    script: Path, argv: list[str], env: dict[str, str], log: Path, *, session: bool = False, err: Path | None = None
) -> ForkedProcess:
    """``python SCRIPT ARGV...`` with ``env`` (CPU only: ``worker_env`` and rank variables), its output in ``log``
    (stderr in ``err`` if given), forked by this pytest worker's fork server (tests/forkserver.py), which starts on
    first use."""
    global _server
    if _server is None or not _server.alive():
        _server = ForkServer(worker_env(), str(ROOT))
    request = {"op": "spawn", "script": str(script), "argv": argv, "env": env, "cwd": str(ROOT), "session": session}
    request |= {"log": str(log), "err": str(err) if err else None}
    return ForkedProcess(_server, _server.ask(request)["pid"])


# What libraries read once, at import: a process that needs other values than the fork server's is started afresh.
_IMPORT_TIME = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "DATASETS", "TORCH", "PYTORCH", "CUDA", "DS_", "OMP_", "MKL_")
_IMPORT_TIME += ("TOKENIZERS", "PYTHON", "HOME", "XDG_", "ACCELERATE", "PATH")


def forkable(env: dict[str, str]) -> bool:
    """Whether a process with ``env`` can be forked by the fork server: ``env`` agrees with the server's (the CPU
    ``worker_env()``) on every variable read at import time (``_IMPORT_TIME``; a GPU run's ``CUDA_VISIBLE_DEVICES``
    does not)."""
    base = worker_env()
    return all(base.get(k) == env.get(k) for k in {*base, *env} if k.startswith(_IMPORT_TIME))


def wait_or_kill(procs: list[Any], timeout: float) -> list[int | None]:
    """``wait``, then SIGKILL whatever still runs (None in the codes for those)."""
    try:
        return wait(procs, timeout)
    finally:
        kill_all(procs)


def run_script(
    script: Path, argv: list[str], env: dict[str, str], log_dir: Path, timeout: float = 400
) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGV...`` to its end, shaped as ``subprocess.run(..., capture_output=True, text=True)``:
    forked by the fork server when ``forkable(env)``, a fresh process otherwise; killed after ``timeout`` seconds
    (scaled)."""
    command = [sys.executable, str(script), *argv]
    if not forkable(env):
        return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=scaled(timeout))
    out, err = log_dir / "stdout.log", log_dir / "stderr.log"
    (code,) = wait_or_kill([fork(script, argv, env, out, err=err)], timeout)
    assert code is not None, f"{script.name} still running after {timeout} s\n" + err.read_text()[-4000:]
    return subprocess.CompletedProcess(command, code, out.read_text(), err.read_text())


def launch_torchrun(runs: list[dict[str, Any]], log_dir: Path, nproc: int) -> subprocess.Popen:
    """Starts the worker under ``torchrun --nproc_per_node nproc`` (in a session of its own); returns the launcher."""
    config = json.dumps({"runs": runs})
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    command += ["--master_port", str(free_port()), str(WORKER), config]
    log = open(log_dir / "rank0.log", "w")  # noqa: SIM115 - closed when the process is reaped
    return subprocess.Popen(
        command, env=worker_env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def wait(procs: list[Any], timeout: float) -> list[int | None]:
    """Exit codes after at most ``timeout`` seconds, stretched by the machine's load (None: still running)."""
    deadline = time.monotonic() + scaled(timeout)
    for proc in procs:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
    return [proc.poll() for proc in procs]


def kill_all(procs: list[Any]) -> None:
    """SIGKILLs the given processes (by their pids) that still run, stopped ones included."""
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)


def logs(log_dir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(log_dir.glob("rank*.log")))


def run_to_end(runs: list[dict[str, Any]], log_dir: Path, world_size: int = 1, timeout: float = 400) -> list[int]:
    """Runs the worker to completion; returns the exit codes (the processes are killed after ``timeout``)."""
    codes = wait_or_kill(launch(runs, log_dir, world_size), timeout)
    assert None not in codes, f"still running after {timeout} s\n" + logs(log_dir)
    return codes


def outcome(spec: dict[str, Any], rank: int = 0) -> dict[str, Any]:
    return json.loads(Path(f"{spec['result']}.rank{rank}.json").read_text())


def final_state(spec: dict[str, Any], rank: int = 0) -> dict[str, Any]:
    return torch.load(f"{spec['result']}.rank{rank}.pt", weights_only=False)


def wait_for_progress(spec: dict[str, Any], rank: int, step: int, procs: list[Any], timeout: float) -> None:
    """Blocks until ``rank`` reported ``step`` in its progress file (fails if the workers exit first)."""
    deadline = time.monotonic() + scaled(timeout)
    path = Path(spec["progress"])
    while time.monotonic() < deadline:
        if path.exists() and any(line.split()[:2] == [str(rank), str(step)] for line in path.read_text().splitlines()):
            return
        if all(proc.poll() is not None for proc in procs):
            break
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} never reported step {step}")


def assert_same_parameters(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert set(a) == set(b) and len(a) > 0
    for name, value in a.items():
        torch.testing.assert_close(b[name], value, atol=atol, rtol=0, msg=name)


def signal_rank_after(
    spec: dict[str, Any], procs: list[Any], rank: int, step: int, sig: int, timeout: float
) -> list[int | None]:
    """Sends ``sig`` to ``rank`` once it reported ``step``, then returns every rank's exit code (all killed after)."""
    try:
        wait_for_progress(spec, rank, step, procs, timeout=timeout)
        os.kill(procs[rank].pid, sig)
        return wait(procs, timeout)
    finally:
        kill_all(procs)
