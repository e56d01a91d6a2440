"""Test-only: run a launcher in its own session, send it a real signal at a known point, and report the exit code of
every process of the launch, orphans included.

``python tests/reaper.py SPEC_JSON``. This process makes itself a child subreaper (``PR_SET_CHILD_SUBREAPER``), so a
launcher's child that outlives the launcher is re-parented here and its exit code is seen (what a container's init
or Slurm's step daemon sees). SPEC holds:

- ``command``, ``env`` (added to this environment), ``log`` (the launch's stdout and stderr);
- ``wait_for``: a file; once it holds ``lines`` lines (default 1) the signal is sent; ``signal`` (``"TERM"``,
  ``"INT"``) to ``target``: ``"launcher"`` (its pid) or ``"group"`` (its whole process group, as Ctrl-C or a
  scheduler that signals every process);
- ``timeout``: seconds for the whole launch (then everything left is SIGKILLed and reported as killed);
- ``report``: where the JSON result goes: ``{"signalled": bool, "launcher": code, "launcher_pid": pid, "processes":
  [{"pid", "cmdline", "parent" (its first parent), "code"}]}``, codes as ``subprocess`` gives them (negative: killed
  by that signal).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36


def _descendants(root: int) -> dict[int, tuple[str, int]]:
    """Every process whose ancestry leads to ``root`` (this process's launch), with its command line and parent."""
    parents, cmdlines = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdlines[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found = {}
    for pid in parents:
        ancestor = pid
        while ancestor in parents and ancestor not in (root, 0, 1):
            ancestor = parents[ancestor]
        if ancestor == root and pid != root:
            found[pid] = (cmdlines.get(pid, ""), parents[pid])
    return found


def _code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def main() -> None:
    spec = json.loads(sys.argv[1])
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    log = open(spec["log"], "w")  # noqa: SIM115 - closed at exit
    launcher = subprocess.Popen(
        spec["command"], env={**os.environ, **spec.get("env", {})}, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + spec.get("timeout", 300)
    seen: dict[int, tuple[str, int]] = {launcher.pid: (" ".join(spec["command"]), os.getpid())}
    codes: dict[int, int] = {}
    signalled = False
    wait_for, lines = Path(spec["wait_for"]), spec.get("lines", 1)
    scanned = 0.0
    while time.monotonic() < deadline:
        if time.monotonic() - scanned > 0.5:
            seen.update({pid: seen.get(pid, found) for pid, found in _descendants(os.getpid()).items()})  # first parent
            scanned = time.monotonic()
        if not signalled and wait_for.exists() and len(wait_for.read_text().splitlines()) >= lines:
            seen.update({pid: seen.get(pid, found) for pid, found in _descendants(os.getpid()).items()})
            sig = getattr(signal, f"SIG{spec['signal']}")
            os.killpg(launcher.pid, sig) if spec["target"] == "group" else os.kill(launcher.pid, sig)
            signalled = True
        try:
            while True:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                codes[pid] = _code(status)
        except ChildProcessError:
            break  # every process of the launch has ended
        time.sleep(0.05)
    for pid in set(_descendants(os.getpid())):
        os.kill(pid, signal.SIGKILL)  # past the timeout: report them as killed
    try:
        while True:
            pid, status = os.waitpid(-1, 0)
            codes[pid] = _code(status)
    except ChildProcessError:
        pass
    report = {
        "signalled": signalled,
        "launcher": codes.get(launcher.pid),
        "launcher_pid": launcher.pid,
        "processes": [
            {"pid": pid, "cmdline": seen.get(pid, ("", 0))[0], "parent": seen.get(pid, ("", 0))[1], "code": code}
            for pid, code in sorted(codes.items())
        ],
    }
    Path(spec["report"]).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
