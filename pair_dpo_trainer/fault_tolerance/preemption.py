"""Preemption: a stop signal (SIGTERM, SIGINT) ends the run with exit code :data:`PREEMPTED_EXIT_CODE` (75), after
the work that must not be lost and never by killing the process outright.

What the handler does depends on the phase (one :class:`StopHandler` of this package is installed at a time; a scope
entered while one is installed leaves it in charge):

- **the training loop** (:class:`PreemptionHandler`, recording from ``on_train_begin``): the handler only records the
  signal. At every optimizer-step boundary the ranks agree on it with one 8-byte all-reduce over the CPU group
  (:func:`~pair_dpo_trainer.parallel.agreement.max_over_ranks_cpu`, no GPU sync), so a signal that reached only some
  ranks stops all of them after the same step, and every rank (the marker too) names that signal; the Trainer saves a
  checkpoint and ``PairDPOTrainer.train`` raises :class:`TrainingPreempted`.
- **a long step outside it** (:func:`stop_on_signal`: loading and tokenising in the trainer's constructor, the start
  of ``train()`` up to the loop, ``evaluate()``, ``train.py`` as a whole): :class:`~pair_dpo_trainer.errors.Preempted`
  is raised at once where the main thread is, so ``finally`` blocks remove temporary files and the interpreter exits
  normally (the output-dir lock is released). A failure after the signal (a peer that stopped first) also ends as
  ``Preempted``.
- **a final write** (``stop_on_signal(..., defer=True)``: ``save_model``, train.py's final save): finished first, then
  ``Preempted``.

A second SIGINT aborts at once (``KeyboardInterrupt``: Ctrl-C twice); a second SIGTERM is ignored (schedulers and
torchrun repeat it). A handler inherited by a forked child does nothing: its parent decides. Every rank that stops
prints one ``pair_dpo: rank R: [preempted] ...`` line, and :data:`PREEMPTED_MARKER` is written into ``output_dir``, so a
requeue script can tell a preemption from a failure where a launcher replaces 75 by its own exit code.

Details: fault_tolerance/README.md, "Module notes", ``preemption.py``.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pair_dpo_trainer.atomic import atomic_open
from pair_dpo_trainer.errors import PREEMPTED_EXIT_CODE, Preempted
from pair_dpo_trainer.stop_signals import STOP_SIGNALS

logger = logging.getLogger(__name__)

__all__ = ["PREEMPTED_EXIT_CODE", "PREEMPTED_MARKER", "Preempted", "TrainingPreempted"]

PREEMPTED_MARKER = "pair_dpo_preempted.json"
"""Written into ``output_dir`` when a run stops on a stop signal; removed when a run starts training there (its
training loop begins), never by a launch that fails before."""

F = TypeVar("F", bound=Callable[..., Any])

_INSTALLED: list[StopHandler] = []


class TrainingPreempted(Preempted):
    """Training stopped on a stop signal after saving ``checkpoint``; exits with :data:`PREEMPTED_EXIT_CODE`.

    Attributes:
        reason_code: ``"preempted"``.
        step: The optimizer step of the saved checkpoint.
        checkpoint: Its directory.
        message: What happened and how to resume.
    """

    def __init__(self, step: int, checkpoint: str, signal_name: str = "SIGTERM") -> None:
        super().__init__(
            f"[preempted] {signal_name}: stopped after optimizer step {step} and saved {checkpoint}; exiting with code "
            f"{PREEMPTED_EXIT_CODE}. Resume with --resume_from_checkpoint latest (or auto)."
        )
        self.step = step
        self.checkpoint = checkpoint


def _note(text: str) -> None:
    os.write(2, f"pair_dpo: {text}\n".encode())  # not logging: a handler may run while the logging lock is held


def _rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


def _signal_name(signum: int | None) -> str:
    return signal.Signals(signum).name if signum is not None else "no signal"


class StopHandler:
    """The stop-signal handler of one phase (main thread only).

    Args:
        phase: What runs, for the messages (``"tokenising the datasets"``).
        mode: ``"raise"`` (raise ``Preempted`` at once), ``"defer"`` (finish, then raise) or ``"record"`` (only record:
            the training loop acts on it).

    Attributes:
        received: The first stop signal received, or None.
    """

    def __init__(self, phase: str, mode: str = "raise") -> None:
        self.phase = phase
        self.mode = mode
        self.received: int | None = None
        self.stopped_during = phase
        self._pid = os.getpid()
        self._previous: dict[int, Any] = {}

    @property
    def signal_name(self) -> str:
        """The received signal's name (``"SIGTERM"``)."""
        return _signal_name(self.received)

    def install(self) -> bool:
        """Installs the handler; False (nothing installed) outside the main thread, where Python takes no signal."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self._pid = os.getpid()
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        _INSTALLED.append(self)
        return True

    def restore(self) -> None:
        """Puts the previous handlers back."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if self in _INSTALLED:
            _INSTALLED.remove(self)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:
            return  # inherited by a forked child (a worker before its filter is installed): its parent decides
        name = signal.Signals(signum).name
        if self.received is not None:
            if signum == signal.SIGINT:
                _note(f"{name} again (pid {os.getpid()}): aborting without saving")
                raise KeyboardInterrupt
            _note(f"{name} again (pid {os.getpid()}): already stopping")
            return
        self.received = signum
        if self.mode == "raise":
            raise self.preempted()
        then = "after this optimizer step" if self.mode == "record" else f"once {self.phase} is done"
        _note(f"{name} received (pid {os.getpid()}): stopping {then}; Ctrl-C twice aborts without saving")

    def preempted(self) -> Preempted:
        """The ``Preempted`` of this phase (raised at once, or after a deferred phase finished)."""
        self.stopped_during = self.phase
        if self.mode == "defer":
            done = f"finished {self.phase}, then stopped"
        else:
            done = f"stopped during {self.phase} (nothing of it is kept: temporary files are removed)"
        return Preempted(
            f"[preempted] {self.signal_name}: {done}; exiting with code {PREEMPTED_EXIT_CODE}. Run the same command "
            "again to go on (train.py: with --resume_from_checkpoint auto)."
        )

    def outcome(self, exc: BaseException | None) -> BaseException | None:
        """What leaves the phase once the handler is restored: ``Preempted`` after a signal (also in place of a failure
        it caused), else ``exc`` as it is."""
        if self.received is None or isinstance(exc, (Preempted, KeyboardInterrupt, GeneratorExit)):
            return exc
        if exc is None and self.mode != "defer":
            return None  # recorded by a loop that acts on it itself
        preempted = self.preempted()
        preempted.__cause__ = exc
        return preempted


class PreemptionHandler(StopHandler):
    """The training run's handler: raises until the training loop starts, then records; ranks agree on it at step
    boundaries.

    Attributes:
        received: The signal number this rank received, or None.
        agreed: The signal number the ranks agreed on at the last step boundary (the largest any rank received, so
            every rank names the same one: SIGTERM over SIGINT), or None.
        stop_step: The step after which all ranks agreed to stop, or None.
    """

    def __init__(self) -> None:
        super().__init__("the start of training", mode="raise")
        self.agreed: int | None = None
        self.stop_step: int | None = None

    def install(self) -> bool:
        self.received = self.agreed = None
        self.stop_step = None
        self.mode, self.phase = "raise", "the start of training (lock, resume, reference, model set-up)"
        installed = super().install()
        if not installed:
            logger.warning("train() runs outside the main thread: a stop signal will not save a checkpoint before exit")
        return installed

    def start_recording(self) -> None:
        """From now on (the training loop) a signal is only recorded; the step boundary acts on it."""
        self.mode = "record"
        self.phase = "training"

    def agree(self) -> bool:
        """Whether any rank received a stop signal, and which (:attr:`agreed`): a collective on every rank, local in
        one process. A rank whose own signal comes later (a launcher's, rank after rank) still names the signal."""
        from pair_dpo_trainer.parallel.agreement import max_over_ranks_cpu  # torch: imported by the training run only

        self.agreed = max_over_ranks_cpu(self.received or 0) or None
        return self.agreed is not None

    @property
    def agreed_signal_name(self) -> str:
        """The agreed signal's name (``"SIGTERM"``), the same on every rank."""
        return _signal_name(self.agreed)


class StopScope:
    """A :class:`StopHandler` for the ``with`` block; inside another phase's handler (raising or deferring), that one
    is borrowed instead: it names this block in its messages and, for ``defer``, finishes the block before stopping.
    The training loop's recording handler is left as it is.

    Args:
        phase: What the block does, for the messages.
        defer: Finish the block, then stop (a final write); else stop at once.
        output_dir: Where :data:`PREEMPTED_MARKER` goes when the block ends in ``Preempted`` (None: nowhere), or a
            callable returning it then.
    """

    def __init__(self, phase: str, *, defer: bool = False, output_dir: Any = None) -> None:
        self.handler = StopHandler(phase, mode="defer" if defer else "raise")
        self.output_dir = output_dir
        self.active = False
        self._borrowed: tuple[StopHandler, str, str] | None = None

    def __enter__(self) -> StopScope:
        if _INSTALLED:
            outer = _INSTALLED[-1]
            self._borrowed = (outer, outer.phase, outer.mode)
            if outer.mode != "record":
                outer.phase = self.handler.phase
                outer.mode = "defer" if self.handler.mode == "defer" else outer.mode
            return self
        self.active = self.handler.install()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self._borrowed is not None:
            outer, phase, mode = self._borrowed
            deferred = exc is None and mode == "raise" and outer.mode == "defer" and outer.received is not None
            preempted = outer.preempted() if deferred else None  # named after this block, before restoring
            outer.phase, outer.mode = phase, mode
            if preempted is not None:
                raise preempted
            return None
        if not self.active:
            return None
        self.handler.restore()
        outcome = self.handler.outcome(exc)
        if isinstance(outcome, Preempted) and self.handler.received is not None:
            output_dir = self.output_dir() if callable(self.output_dir) else self.output_dir
            stop_process_group()
            marker = {"phase": self.handler.stopped_during, "signal": self.handler.signal_name}
            announce(outcome, output_dir, marker=marker)
        if outcome is exc:
            return None
        raise outcome  # type: ignore[misc]  # not None: it differs from exc only as a Preempted


def stop_on_signal(phase: str, *, defer: bool = False, output_dir: Any = None) -> StopScope:
    """A ``with`` block that a stop signal ends with ``Preempted`` (exit code 75), see the module docstring."""
    return StopScope(phase, defer=defer, output_dir=output_dir)


def stops_on_signal(phase: str, *, defer: bool = False) -> Callable[[F], F]:
    """Decorates a trainer method: its call runs in :func:`stop_on_signal` (the marker goes to ``self.args``'
    ``output_dir``)."""

    def decorate(method: F) -> F:
        @functools.wraps(method)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            with stop_on_signal(phase, defer=defer, output_dir=lambda: _output_dir(self)):
                return method(self, *args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def _output_dir(trainer: Any) -> str | None:
    args = getattr(trainer, "args", None)
    return getattr(args, "output_dir", None)


def stop_process_group() -> None:
    """Destroys the default process group without a barrier (a peer may be gone): a gloo group alive at interpreter
    exit can abort the process instead of letting it exit with 75."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # best effort on the way out
        logger.debug("could not destroy the process group on the way out", exc_info=True)


def announce(preempted: Preempted, output_dir: str | None, *, marker: dict[str, Any] | None = None) -> None:
    """Prints this rank's ``[preempted]`` line; writes :data:`PREEMPTED_MARKER` into ``output_dir`` (when given)."""
    _note(f"rank {_rank()}: {preempted.message}")
    if output_dir is None or marker is None:
        return
    record = {
        "exit_code": PREEMPTED_EXIT_CODE,
        **marker,
        "message": preempted.message,
        "rank": _rank(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        with atomic_open(Path(output_dir) / PREEMPTED_MARKER) as f:
            json.dump(record, f, indent=1)
            f.write("\n")
    except OSError as exc:  # the exit code and the line above still say it
        _note(f"could not write {Path(output_dir) / PREEMPTED_MARKER}: {exc}")


def clear_marker(output_dir: str | os.PathLike[str]) -> None:
    """Removes an earlier run's :data:`PREEMPTED_MARKER` (a run starting in ``output_dir``)."""
    try:
        (Path(output_dir) / PREEMPTED_MARKER).unlink(missing_ok=True)
    except OSError:
        pass
