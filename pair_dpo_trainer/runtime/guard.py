"""``RunGuard``: the trainer's one entry point to fault tolerance (lock, timeouts, preemption, atomic checkpoints).

``PairDPOTrainer`` calls it in three places and nowhere else:

- ``train()`` runs inside :meth:`RunGuard.session`: the output-dir lock (main process; every rank learns the
  outcome), ``ddp_timeout`` on every process group, the resume checkpoint resolved (``latest`` / ``auto``), staged
  leftovers of an interrupted run removed, the SIGTERM handler and the step-boundary callback installed; on the way
  out a preemption becomes :class:`~pair_dpo_trainer.runtime.preemption.TrainingPreempted` and a collective that
  timed out or lost its peer becomes ``collective_timeout`` / ``peer_lost``.
- ``get_train_dataloader()`` passes the schedule fingerprint to :meth:`RunGuard.check_schedule` (compared with the
  resumed checkpoint's, recorded in every new one).
- ``_save_checkpoint()`` delegates to :meth:`RunGuard.save_checkpoint` (``runtime/checkpoint.py``).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from pair_dpo_trainer.distributed import all_gather_cpu, assert_ranks_agree
from pair_dpo_trainer.errors import RunError
from pair_dpo_trainer.runtime.checkpoint import (
    SaveRequest,
    checkpoint_problem,
    clear_leftovers,
    save_checkpoint_atomically,
)
from pair_dpo_trainer.runtime.collectives import (
    apply_collective_timeout,
    check_nccl_error_handling,
    collective_failure,
    end_process_group,
)
from pair_dpo_trainer.runtime.lock import acquire_output_dir, release_output_dir
from pair_dpo_trainer.runtime.preemption import PreemptionHandler, TrainingPreempted
from pair_dpo_trainer.runtime.resume import check_resumed_schedule, resolve_resume

if TYPE_CHECKING:
    from pair_dpo_trainer.config import PairDPOConfig

logger = logging.getLogger(__name__)


class RunGuard:
    """Fault tolerance of one trainer's runs.

    Args:
        args: The ``PairDPOConfig`` (``output_dir``, ``ddp_timeout``, ``allow_resume_data_mismatch``, ranks).
    """

    def __init__(self, args: PairDPOConfig) -> None:
        self.args = args
        self.preemption = PreemptionHandler()
        self.resume_checkpoint: str | None = None
        self.schedule_fingerprint: str | None = None
        self._locked: str | None = None

    @property
    def _is_main(self) -> bool:
        return self.args.process_index == 0

    @property
    def _output_dir(self) -> str:
        """``args.output_dir`` (``TrainingArguments`` always sets one)."""
        return str(self.args.output_dir)

    @contextlib.contextmanager
    def session(self, trainer: Any, resume_from_checkpoint: str | bool | None) -> Iterator[str | None]:
        """Wraps one ``train()`` call; yields the checkpoint to resume from (None: fresh start). Every rank enters it.

        Raises:
            RunError: ``output_dir_in_use`` (on every rank), ``collective_timeout``, ``peer_lost``.
            CheckpointError: ``no_checkpoint``, ``checkpoint_incomplete`` (see ``runtime/resume.py``).
            ConfigError: ``unsupported_combination`` for NCCL without a collective timeout.
            TrainingPreempted: after a SIGTERM, once the checkpoint is saved on every rank.
        """
        check_nccl_error_handling()
        apply_collective_timeout(self.args.ddp_timeout)
        self._lock(trainer)
        self.resume_checkpoint = self._resolve(resume_from_checkpoint)
        callback = _GuardCallback(self)
        trainer.add_callback(callback)
        self.preemption.install()
        try:
            yield self.resume_checkpoint
            self._finish(trainer)
        except RuntimeError as exc:
            failure = collective_failure(exc, timeout_s=self.args.ddp_timeout, rank=self.args.process_index)
            if failure is None:
                raise
            raise failure from exc
        finally:
            self.preemption.restore()
            trainer.remove_callback(callback)

    def check_schedule(self, fingerprint: str) -> None:
        """Records the train schedule's fingerprint; on resume refuses a checkpoint of another schedule.

        Raises:
            CheckpointError: ``resume_data_mismatch`` (unless ``allow_resume_data_mismatch``).
        """
        self.schedule_fingerprint = fingerprint
        if self.resume_checkpoint is not None:
            check_resumed_schedule(
                self.resume_checkpoint,
                fingerprint,
                allow_mismatch=bool(getattr(self.args, "allow_resume_data_mismatch", False)),
                warn=self._is_main,
            )

    def save_checkpoint(self, trainer: Any, trial: Any, write: Callable[[], None], *, identity: Any) -> Path:
        """The Trainer's save (``write``), made atomic (see ``runtime/checkpoint.py``). Every rank calls it."""
        request = SaveRequest(identity=identity, schedule_fingerprint=self.schedule_fingerprint)
        return save_checkpoint_atomically(trainer, trial, write, request)

    # ------------------------------------------------------------------ internals
    def _lock(self, trainer: Any) -> None:
        """The main process takes the output-dir lock (once per trainer); every rank learns the outcome.

        Processes that share a process group but are each their own Trainer "main process" all try; one is refused,
        so all stop. ``launch.py`` refuses such launches first (``launch_not_one_job``; torchrun without ``use_cpu``
        on a CPU-only machine now forms one job); the lock stays the last line for a shared ``output_dir``.
        """
        if self._locked == self._output_dir:
            return
        refusal = None
        if self._is_main:
            try:
                warning = acquire_output_dir(self._output_dir)
            except RunError as exc:
                refusal = (exc.reason_code, exc.message)
            else:
                if warning:
                    logger.warning(warning)
                weakref.finalize(trainer, release_output_dir, self._output_dir)
        refusals = [r for r in all_gather_cpu(refusal) if r is not None]  # any rank that tried and was refused
        if refusals:
            raise RunError(*refusals[0])
        self._locked = self._output_dir

    def _resolve(self, resume_from_checkpoint: str | bool | None) -> str | None:
        """Resolves the checkpoint on every rank (they must agree), then clears an interrupted run's leftovers."""
        resume = resolve_resume(resume_from_checkpoint, self._output_dir, warn=self._is_main)
        if self._is_main:
            clear_leftovers(self._output_dir)
        assert_ranks_agree("checkpoint to resume from", str(resume))
        if resume is not None and self._is_main:
            logger.warning("resuming from %s", resume)
        return resume

    def _finish(self, trainer: Any) -> None:
        """After ``Trainer.train`` returned: a SIGTERM (even one after the last step boundary) ends in
        ``TrainingPreempted`` once a checkpoint of the last step is complete."""
        handler = self.preemption
        if handler.stop_step is None and handler.agree():  # signalled after the last step boundary
            handler.stop_step = trainer.state.global_step
        if handler.stop_step is None:
            return
        if all_gather_cpu(checkpoint_problem(self._checkpoint_dir(trainer)) is not None)[0]:
            trainer._save_checkpoint(trainer.model, None)  # not saved yet (e.g. save_strategy="best" skipped it)
        preempted = TrainingPreempted(handler.stop_step, str(self._checkpoint_dir(trainer)))
        if self._is_main:
            logger.warning(preempted.message)
        end_process_group()  # the process exits with 75 next; a live gloo group can turn that into an abort
        raise preempted

    @staticmethod
    def _checkpoint_dir(trainer: Any) -> Path:
        return Path(trainer._get_output_dir(trial=None)) / f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"


class _GuardCallback(TrainerCallback):
    """Step-boundary hooks: ``ddp_timeout`` on the groups the Trainer built (DeepSpeed's), and the preemption stop."""

    def __init__(self, guard: RunGuard) -> None:
        self.guard = guard

    def on_train_begin(self, args, state, control, **kwargs):
        apply_collective_timeout(args.ddp_timeout)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        handler = self.guard.preemption
        if handler.stop_step is None and handler.agree():
            handler.stop_step = state.global_step
            control.should_save = True
            control.should_training_stop = True
            if args.process_index == 0:
                logger.warning("SIGTERM: stopping after step %d and saving a checkpoint", state.global_step)
        return control
