"""Launchers that pass no stop signal on: ``accelerate launch`` with one process, and the ``deepspeed`` command.

torchrun and ``accelerate launch`` with several processes hand a SIGTERM to each rank's process group, the deepspeed
launcher's ``launch.py`` to every descendant. Two processes the user starts do not: accelerate's single-process
launcher runs the script with ``subprocess.Popen`` and installs no handler, and the ``deepspeed`` command (its
``runner.py``, on one node) starts ``launch.py`` the same way; a SIGTERM to either kills it alone (exit 143) and the
orphaned run trains on. :func:`follow_launcher`, called at start, detects them and makes the run stop when they die:
the kernel sends this process SIGTERM when accelerate's launcher (its parent) dies (``PR_SET_PDEATHSIG``); a thread
sends it when ``launch.py`` (its parent) loses the ``deepspeed`` command (its grandparent). The run then stops as on
any SIGTERM (finish the step, save, exit 75, write the preemption marker) and says once that the scheduler sees the
launcher's 143, not 75. accelerate 1.16 and later pass the signal on themselves (to this process and every
process under it) and SIGKILL what still runs 5 s later: the run then says that the step and the save must fit in
those 5 s.

Details: docs/guide.md section 12 (what each launcher does with the signal).
How a launcher is detected: fault_tolerance/README.md, "Module notes", ``launcher.py``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
from importlib import metadata
from pathlib import Path

from packaging.version import Version

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
POLL_SECONDS = 1.0
"""How often a rank under the deepspeed launcher checks that the ``deepspeed`` command still runs."""

ACCELERATE_KILL_AFTER_SECONDS = 5
"""accelerate 1.16+: how long its single-process launcher waits after passing SIGTERM on before it SIGKILLs."""

_followed: set[int] = set()  # pids (this process, a forked child) that already asked


def _words(pid: int) -> list[str]:
    """The base names of ``pid``'s command-line words ([] when it cannot be read)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []
    return [os.path.basename(arg.decode(errors="replace")) for arg in argv if arg]


def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` (``/proc``), None when it cannot be read."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def deepspeed_runner(pid: int) -> bool:
    """Whether ``pid`` is the ``deepspeed`` command (``deepspeed.launcher.runner``), which forwards no signal on one
    node."""
    words = _words(pid)
    return "deepspeed.launcher.runner" in words or any(word == "deepspeed" and i <= 1 for i, word in enumerate(words))


def accelerate_simple_launcher(pid: int) -> bool:
    """Whether process ``pid`` is ``accelerate launch`` running one process (its simple launcher).

    ``accelerate launch`` with several processes runs torchrun inside the launcher, which forwards signals: its
    children have ``TORCHELASTIC_RUN_ID`` set, so only this process's own environment can tell the two apart.
    """
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return False
    words = _words(pid)
    if "accelerate-launch" in words or "accelerate.commands.launch" in words:
        return True
    for i, word in enumerate(words[:-1]):
        if word in ("accelerate", "accelerate.commands.accelerate_cli") and words[i + 1] == "launch":
            return True
    return False


def accelerate_passes_sigterm_on() -> bool:
    """Whether the installed accelerate's single-process launcher passes SIGTERM on to its process tree (1.16+)
    instead of dying alone."""
    try:
        return Version(metadata.version("accelerate")) >= Version("1.16")
    except (metadata.PackageNotFoundError, ValueError):
        return False


_NOT_FORWARDED = (
    "%s does not pass SIGTERM on to the training processes: this process stops (saves a checkpoint, exits 75) when "
    "that launcher dies, but the launcher itself exits with 143 and that is what a scheduler sees."
)
_KILLED_AFTER = (
    "%s passes SIGTERM on to this process and every process under it, and SIGKILLs what still runs "
    f"{ACCELERATE_KILL_AFTER_SECONDS} s later: the optimizer step under way and the checkpoint must finish within "
    "those seconds, or the run ends at its last complete checkpoint; the launcher exits with 143, not 75."
)
_HOW_TO = (
    " Send the signal to the whole process group, or start the run so that it gets the signal itself (python "
    "train.py for one process, torchrun for several): docs/guide.md section 12."
)


def follow_launcher() -> bool:
    """Makes this process stop (SIGTERM) when a launcher that forwards no signal dies (module docstring).

    Returns:
        Whether this process follows such a launcher now (False elsewhere, and off Linux).
    """
    if os.getpid() in _followed:
        return True
    parent = os.getppid()
    if accelerate_simple_launcher(parent) and _set_parent_death_signal(signal.SIGTERM):
        launcher, says = "accelerate launch with one process", _NOT_FORWARDED
        if accelerate_passes_sigterm_on():
            says = _KILLED_AFTER
        if os.getppid() != parent:  # it died before the kernel was asked: no signal will come
            os.kill(os.getpid(), signal.SIGTERM)
    elif "deepspeed.launcher.launch" in _words(parent) and deepspeed_runner(runner := parent_of(parent) or 0):
        launcher, says = "the deepspeed command (on one node)", _NOT_FORWARDED
        threading.Thread(target=_watch, args=(parent, runner), name="pair-dpo-launcher-watch", daemon=True).start()
    else:
        return False
    _followed.add(os.getpid())
    logger.warning(says + _HOW_TO, launcher)
    return True


def _watch(parent: int, runner: int) -> None:
    """Under deepspeed's ``launch.py``: SIGTERM to this process once ``launch.py`` is no longer the runner's child."""
    while parent_of(parent) == runner:
        time.sleep(POLL_SECONDS)
    os.kill(os.getpid(), signal.SIGTERM)


def _set_parent_death_signal(signum: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # the process's own symbols: libc's prctl on Linux
        return libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux
        return False
