"""Worker processes without paying the imports each time: a fork server per pytest worker.

A fault test needs real processes (real signals, real exit codes, real ``RANK``/``WORLD_SIZE`` groups), and almost all
of a fresh ``python tests/fault_worker.py`` is its imports (torch, transformers, peft through transformers, the package:
~5.5 s of a ~6.5 s four-step run on this machine). The server is started once with the CPU environment, imports the
worker's module, and then forks one child per launch: each child is a real process (its own pid, process group or
session, signal dispositions at their defaults, stdout/stderr to the launch's log file, the launch's environment and
working directory) that runs a worker script as ``__main__`` as ``python tests/fault_worker.py CONFIG`` would, exits
with its code, dies by SIGINT on an uncaught ``KeyboardInterrupt`` as the interpreter does, and is reaped by the
server, which reports its exit code as ``subprocess.Popen.poll`` would (``-N`` for signal N).

The server itself never trains, computes or starts a thread, so a child inherits no OpenMP pool, no process group and
no lock held by another thread. A launch the server cannot reproduce exactly (an environment that differs in a
variable libraries read at import, a GPU run's among them) is a fresh process instead (``tests/faults.py:
forkable``).
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

_REAP_INTERVAL_S = 0.05


def _run_child(request: dict[str, Any]) -> None:
    """In the forked child: become the launched process, run the script as ``__main__``, never return."""
    code = 1
    try:
        if request["session"]:
            os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        for fd, path in ((1, request["log"]), (2, request.get("err") or request["log"])):
            opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if fd == 1 else 0), 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        script = request["script"]
        sys.argv = [script, *request["argv"]]
        sys.path.insert(0, os.path.dirname(script))  # as ``python SCRIPT`` puts the script's folder first
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = _exit_code(exit_.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # as the interpreter does: die by the signal, not exit 1
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()  # the interpreter's shutdown, which os._exit skips
        _flush()
        os._exit(code)


def _exit_code(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _serve() -> None:
    """The server's loop: one JSON request per line on stdin, one JSON answer per line on stdout."""
    from tests import fault_worker  # noqa: F401 - torch, transformers, the package: what every child inherits

    codes: dict[int, int] = {}
    children: set[int] = set()
    reader = sys.stdin.buffer
    while True:
        ready, _, _ = select.select([reader], [], [], _REAP_INTERVAL_S)
        _reap(children, codes)
        if not ready:
            continue
        line = reader.readline()
        if not line:
            return  # the test process is gone
        request = json.loads(line)
        if request["op"] == "spawn":
            pid = os.fork()
            if pid == 0:
                _run_child(request)
            children.add(pid)
            answer: dict[str, Any] = {"pid": pid}
        else:  # reaped just above
            answer = {"code": codes.get(request["pid"])}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


def _reap(children: set[int], codes: dict[int, int]) -> None:
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)
            codes[pid] = os.waitstatus_to_exitcode(status)


class ForkServer:
    """The client: one server process, started on first use with ``env``, asked for children and their exit codes."""

    def __init__(self, env: dict[str, str], cwd: str) -> None:
        self._errors = tempfile.TemporaryFile()  # noqa: SIM115 - the server's stderr, shown if it dies
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.forkserver"],
            env=env,
            cwd=cwd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._errors,
        )
        atexit.register(self.close)

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write((json.dumps(request) + "\n").encode())
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            self._errors.seek(0)
            raise RuntimeError(
                f"the fork server exited with {self._proc.wait()}:\n{self._errors.read().decode()[-4000:]}"
            )
        return json.loads(line)

    def alive(self) -> bool:
        return self._proc.poll() is None

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()  # type: ignore[union-attr]
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()


class ForkedProcess:
    """What the fault tests use of ``subprocess.Popen`` (pid, poll, wait, send_signal, kill, returncode) for a child
    of the fork server."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self._server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.ask({"op": "poll", "pid": self.pid})["code"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
            time.sleep(_REAP_INTERVAL_S)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    _serve()
