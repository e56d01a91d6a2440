"""Stop signals (SIGTERM, SIGINT) in worker processes: only the parent ends a worker, a signal meant for the job does
not.

A job's stop signal reaches more than the job's main processes: ``kill -TERM -PGID``, Ctrl-C (SIGINT to the terminal's
foreground group), torchrun (``killpg`` of each rank's group) and the deepspeed launcher (SIGTERM to every descendant)
all reach DataLoader workers and tokenising workers too. A worker that dies of it makes its parent fail
(``DataLoader worker ... is killed by signal: Terminated``) before the parent can finish its step and save.
:func:`worker_stop_filter`, run first in each worker, keeps the one rule torch's own worker handler has (SIGTERM from
the parent: exit at once, silently) and ignores every other SIGTERM / SIGINT; the worker also exits once its parent is
gone. Ignoring with ``SIG_IGN`` instead would also ignore the parent's own ``terminate()`` and can hang the parent's
exit.

Details: pair_dpo_trainer/README.md, "Module notes", ``stop_signals.py``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""The signals that stop a run: SIGTERM (schedulers, launchers, ``kill``) and SIGINT (Ctrl-C)."""

PARENT_POLL_SECONDS = 1.0
"""How often a filtered worker checks that its parent still exists."""


def worker_stop_filter(main_pid: int | None = None) -> None:
    """Makes this (worker) process ignore stop signals that do not come from its parent.

    Blocks SIGTERM and SIGINT in every thread of the process and starts one daemon thread that takes them with
    ``sigtimedwait`` (which reports the sender): SIGTERM from the parent (or ``main_pid``, the process that owns the
    worker when the parent is a fork server) ends the process with ``os._exit(0)``, as torch's DataLoader worker
    handler does; any other SIGTERM or SIGINT is dropped. The thread also ends the process once the parent is gone
    (the process was re-parented), so an orphaned worker never outlives its job.

    Call it first in the worker, from its main thread, before the worker starts other threads (they inherit the
    mask). A no-op where the platform lacks ``sigtimedwait`` (not Linux).

    Args:
        main_pid: The pid of the process the worker serves, when that is not its parent.
    """
    if not hasattr(signal, "sigtimedwait"):  # pragma: no cover - not Linux
        return
    parent = os.getppid()
    allowed = {parent} | ({main_pid} if main_pid else set())
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    threading.Thread(target=_filter, args=(parent, allowed), name="pair-dpo-stop-filter", daemon=True).start()


def _filter(parent: int, allowed: set[int]) -> None:
    while True:
        info = signal.sigtimedwait(STOP_SIGNALS, PARENT_POLL_SECONDS)
        if info is not None and info.si_signo == signal.SIGTERM and info.si_pid in allowed:
            os._exit(0)  # the parent ends its worker (DataLoader shutdown, a broken pool's terminate())
        if os.getppid() != parent:
            os._exit(0)  # orphaned: nobody will read this worker's results


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Blocks SIGTERM and SIGINT in this thread while the block runs (signals that arrive meanwhile are delivered
    when it ends): processes forked inside start with them blocked, so no stop signal reaches a worker between its
    fork and :func:`worker_stop_filter`."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
