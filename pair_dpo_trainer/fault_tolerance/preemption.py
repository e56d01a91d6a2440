"""Preemption: on SIGTERM the job finishes the current optimizer step, saves a complete checkpoint on every rank, and
exits with :data:`PREEMPTED_EXIT_CODE`.

The handler only records the signal. At every optimizer-step boundary (``on_step_end``, never per micro-batch) the
ranks agree on it with one 8-byte all-reduce over the CPU group
(:func:`~pair_dpo_trainer.parallel.agreement.any_rank_cpu`,
no GPU sync): a signal that reached only some ranks (a scheduler that signals one node, a user's ``kill``) stops all
of them after the same step. The Trainer then saves a checkpoint (``control.should_save``, whatever the save
strategy) and ends the loop; ``PairDPOTrainer.train`` raises :class:`TrainingPreempted`, a ``SystemExit`` with code
75 (``EX_TEMPFAIL``: "try again later"), so an uncaught one ends the script with that code and nothing after
``train()`` runs.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

from pair_dpo_trainer.parallel.agreement import any_rank_cpu

logger = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75
"""Exit status of a run stopped by SIGTERM after saving its checkpoint (``EX_TEMPFAIL`` of ``sysexits.h``)."""

PREEMPTION_SIGNALS = (signal.SIGTERM,)


class TrainingPreempted(SystemExit):
    """Training stopped on SIGTERM after saving ``checkpoint``; exits with :data:`PREEMPTED_EXIT_CODE`.

    Attributes:
        reason_code: ``"preempted"``.
        step: The optimizer step of the saved checkpoint.
        checkpoint: Its directory.
        message: What happened and how to resume.
    """

    reason_code = "preempted"

    def __init__(self, step: int, checkpoint: str) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step = step
        self.checkpoint = checkpoint
        self.message = (
            f"[preempted] SIGTERM: stopped after optimizer step {step} and saved {checkpoint}; exiting with code "
            f"{PREEMPTED_EXIT_CODE}. Resume with --resume_from_checkpoint latest (or auto)."
        )


class PreemptionHandler:
    """Records SIGTERM while installed (main thread only); ranks agree on it at step boundaries.

    Attributes:
        received: The signal number received, or None.
        stop_step: The step after which all ranks agreed to stop, or None.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self.stop_step: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Installs the handler (a no-op outside the main thread, where Python cannot handle signals)."""
        self.received = None
        self.stop_step = None
        if threading.current_thread() is not threading.main_thread():
            logger.warning("train() runs outside the main thread: SIGTERM will not save a checkpoint before exit")
            return
        for sig in PREEMPTION_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        """Puts the previous handlers back."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum
            note = f"pair_dpo: {signal.Signals(signum).name} received (pid {os.getpid()}): stopping after this step\n"
            os.write(2, note.encode())  # not logging: a handler may run while the logging lock is held

    def agree(self) -> bool:
        """Whether any rank received the signal (a collective on every rank; local in one process)."""
        return any_rank_cpu(self.received is not None)
