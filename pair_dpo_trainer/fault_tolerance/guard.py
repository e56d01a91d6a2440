"""``RunGuard``: the trainer's one entry point to fault tolerance (lock, timeouts, preemption, atomic checkpoints).

``PairDPOTrainer`` calls it in three places and nowhere else:

- ``train()`` runs inside :meth:`RunGuard.session`: the output-dir lock (main process; every rank learns the
  outcome; every node must see it), ``ddp_timeout`` on every process group, the resume checkpoint resolved
  (``latest`` / ``auto``), staged leftovers of an interrupted run removed, the SIGTERM handler and the step-boundary
  callback installed (its ``on_train_begin`` moves the newer checkpoints aside after an explicit resume of an older
  step); on the way out a preemption becomes
  :class:`~pair_dpo_trainer.fault_tolerance.preemption.TrainingPreempted` and a collective that timed out or lost its
  peer becomes ``collective_timeout`` / ``peer_lost``, naming the lost ranks and their hosts.
- ``get_train_dataloader()`` passes the schedule fingerprint to :meth:`RunGuard.check_schedule` (compared with the
  resumed checkpoint's, recorded in every new one).
- ``_save_checkpoint()`` delegates to :meth:`RunGuard.save_checkpoint` (``fault_tolerance/checkpoint.py``).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from pair_dpo_trainer.errors import Preempted, RunError
from pair_dpo_trainer.fault_tolerance.checkpoint import (
    SaveRequest,
    checkpoint_problem,
    checkpoint_step,
    clear_leftovers,
    move_aside,
    recorded_nonfinite_grad_skips,
    save_checkpoint_atomically,
)
from pair_dpo_trainer.fault_tolerance.checkpoint_trust import deepspeed_loads_tag, verify_resume_checkpoint
from pair_dpo_trainer.fault_tolerance.launcher import follow_launcher
from pair_dpo_trainer.fault_tolerance.lock import acquire_output_dir, release_output_dir
from pair_dpo_trainer.fault_tolerance.preemption import (
    PreemptionHandler,
    TrainingPreempted,
    announce,
    clear_marker,
    stop_process_group,
)
from pair_dpo_trainer.fault_tolerance.resume import (
    check_resumed_schedule,
    check_resumed_settings,
    is_explicit,
    newer_checkpoints,
    resolve_resume,
)
from pair_dpo_trainer.fault_tolerance.shared_dir import NodeView, check_output_dir_shared
from pair_dpo_trainer.parallel.agreement import all_gather_cpu, assert_ranks_agree, is_multiprocess
from pair_dpo_trainer.parallel.collectives import (
    apply_collective_timeout,
    check_nccl_error_handling,
    collective_failure,
    end_process_group,
)
from pair_dpo_trainer.parallel.roll_call import RollCall, describe_lost

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GuardOptions:
    """What fault tolerance reads of the run's options.

    Attributes:
        output_dir: The run's output directory (locked, checkpointed into).
        ddp_timeout: Seconds a collective may wait before the job ends (``collective_timeout``).
        rank: This process's global rank.
        allow_resume_data_mismatch: Resume a checkpoint of another schedule instead of refusing it.
        node_id: Global rank of this node's local main process.
        local_main: This process is its node's local main.
        save_on_each_node: ``TrainingArguments.save_on_each_node`` (refused on more than one node).
        resume_settings: The run's data and objective settings (``training/resume_settings.py``): recorded in every
            checkpoint and compared on resume (None: neither).
    """

    output_dir: str
    ddp_timeout: float
    rank: int = 0
    allow_resume_data_mismatch: bool = False
    node_id: int = 0
    local_main: bool = True
    save_on_each_node: bool = False
    resume_settings: Mapping[str, Any] | None = None


class RunGuard:
    """Fault tolerance of one trainer's runs; each :meth:`session` reads the options as they are when it starts."""

    def __init__(self) -> None:
        self.options = GuardOptions(output_dir=".", ddp_timeout=1800.0)
        self.preemption = PreemptionHandler()
        self.resume_checkpoint: str | None = None
        self.abandoned: list[Path] = []  # newer checkpoints an explicit resume moved aside (main process)
        self._to_abandon: list[Path] = []
        self.deepspeed_tag: str | None = None  # the tag of resume_checkpoint that was scanned, loaded as such
        self.schedule_fingerprint: str | None = None
        self._locked: str | None = None
        self._roll_call: RollCall | None = None
        self.views: list[NodeView] = []  # every rank's node and host (rank order), known once the lock is taken

    @property
    def _is_main(self) -> bool:
        return self.options.rank == 0

    @property
    def _output_dir(self) -> str:
        return self.options.output_dir

    @contextlib.contextmanager
    def session(
        self, trainer: Any, resume_from_checkpoint: str | bool | None, options: GuardOptions
    ) -> Iterator[str | None]:
        """Wraps one ``train()`` call; yields the checkpoint to resume from (None: fresh start). Every rank enters it.

        ``options`` are what fault tolerance reads of the run's options (``training.options.guard_options``).

        Raises:
            RunError: ``output_dir_in_use`` (on every rank), ``output_dir_not_shared`` (the nodes of a multi-node
                run see different directories), ``collective_timeout``, ``peer_lost``.
            CheckpointError: ``no_checkpoint``, ``checkpoint_incomplete`` (see ``fault_tolerance/resume.py``),
                ``checkpoint_tampered``, ``checkpoint_unsafe_pickle``, ``checkpoint_unsafe_path``,
                ``checkpoint_special_file`` (``fault_tolerance/checkpoint_trust.py``).
            ConfigError: ``unsupported_combination`` for NCCL without a collective timeout, or ``save_on_each_node``
                on more than one node.
            TrainingPreempted: after a stop signal in the training loop, once the checkpoint is saved on every rank.
            Preempted: after a stop signal before the loop (nothing saved).
        """
        self.options = options
        self.preemption.install()  # a stop signal raises until the training loop starts, then is recorded
        callback = _GuardCallback(self)
        added = False
        self._roll_call = None
        try:
            follow_launcher()
            check_nccl_error_handling()
            apply_collective_timeout(self.options.ddp_timeout)
            self._lock(trainer)
            self.resume_checkpoint = self._resolve(resume_from_checkpoint)
            if is_multiprocess():
                self._roll_call = RollCall(self.options.rank, len(self.views)).start()
            trainer.add_callback(callback)
            added = True
            with deepspeed_loads_tag(self.resume_checkpoint, self.deepspeed_tag):
                yield self.resume_checkpoint
            self._finish(trainer)
        except BaseException as exc:
            outcome = self._outcome(exc)
            if outcome is exc:
                raise
            raise outcome from exc
        finally:
            if self._roll_call is not None:
                self._roll_call.stop()
            self.preemption.restore()
            if added:
                trainer.remove_callback(callback)

    def node_ranks(self) -> list[int] | None:
        """The ranks of this process's node when the job spans more than one node (else None); known in a session."""
        if len({view.node_id for view in self.views}) <= 1:
            return None
        return [rank for rank, view in enumerate(self.views) if view.node_id == self.options.node_id]

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
                allow_mismatch=self.options.allow_resume_data_mismatch,
                warn=self._is_main,
            )

    def save_checkpoint(
        self, trainer: Any, trial: Any, write: Callable[[], None], *, identity: Any, nonfinite_grad_skips: int = 0
    ) -> Path:
        """The Trainer's save (``write``), made atomic (see ``fault_tolerance/checkpoint.py``). Every rank calls it.

        ``nonfinite_grad_skips``: the run's count of skipped non-finite steps, recorded for a resume to continue."""
        request = SaveRequest(
            identity=identity,
            schedule_fingerprint=self.schedule_fingerprint,
            settings=self.options.resume_settings,
            protect=self._protected(trainer.state.global_step),
            nonfinite_grad_skips=nonfinite_grad_skips,
        )
        return save_checkpoint_atomically(trainer, trial, write, request)

    def resumed_nonfinite_grad_skips(self) -> int:
        """The count of skipped non-finite steps the resumed checkpoint records (0 on a fresh start)."""
        return recorded_nonfinite_grad_skips(self.resume_checkpoint)

    def _protected(self, step: int) -> tuple[str, ...]:
        """The resumed checkpoint while no newer checkpoint of this line exists (rotation keeps it)."""
        resumed = self.resume_checkpoint
        resumed_step = None if resumed is None else checkpoint_step(Path(resumed))
        return (resumed,) if resumed is not None and (resumed_step is None or step <= resumed_step) else ()

    def abandon_newer_checkpoints(self) -> None:
        """Before the first step of an explicit resume of an older step: the output directory's newer checkpoints
        (the abandoned line) are renamed ``abandoned-checkpoint-N-<time>``, so that ``latest`` / ``auto`` and
        rotation never take them for this line's; listed in the log. Main process (the one that saves)."""
        pending, self._to_abandon = self._to_abandon, []
        if not pending or not self._is_main:
            return
        self.abandoned = move_aside(pending)
        listing = ", ".join(f"{old.name} -> {new.name}" for old, new in zip(pending, self.abandoned, strict=True))
        logger.warning(
            "resuming %s, an older step than the newest checkpoint: the newer checkpoints of the abandoned run are "
            "moved aside so that latest/auto never resume them (rename one back to resume it): %s",
            self.resume_checkpoint,
            listing,
        )

    # ------------------------------------------------------------------ internals
    def _lock(self, trainer: Any) -> None:
        """The main process takes the output-dir lock (once per trainer); every rank learns the outcome.

        Processes that share a process group but are each their own Trainer "main process" all try; one is refused,
        so all stop. ``launch.py`` refuses such launches first (``launch_not_one_job``; torchrun without ``use_cpu``
        on a CPU-only machine now forms one job); the lock stays the last line for a shared ``output_dir``. On more
        than one node, each node's local main then checks that it sees that lock (``shared_dir.py``).
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
        options = self.options
        self.views = check_output_dir_shared(  # output_dir_not_shared: every node must see the lock just taken
            self._output_dir,
            node_id=options.node_id,
            local_main=options.local_main,
            save_on_each_node=options.save_on_each_node,
        )
        self._locked = self._output_dir

    def _resolve(self, resume_from_checkpoint: str | bool | None) -> str | None:
        """Resolves the checkpoint on every rank (they must agree), clears an interrupted run's leftovers, and
        verifies the checkpoint (``checkpoint_trust.py``: its hashes and pickles, read by the main process)."""
        resume = resolve_resume(resume_from_checkpoint, self._output_dir, warn=self._is_main)
        if self._is_main:
            clear_leftovers(self._output_dir)
        self._to_abandon = []
        if resume is not None and self._is_main and is_explicit(resume_from_checkpoint):
            self._to_abandon = newer_checkpoints(self._output_dir, resume)  # moved aside once training starts
        assert_ranks_agree("checkpoint to resume from", str(resume))
        self.deepspeed_tag = None
        if resume is not None:  # before anything of it is unpickled or loaded
            self.deepspeed_tag = verify_resume_checkpoint(resume, is_main=self._is_main)
            options = self.options
            check_resumed_settings(
                resume, options.resume_settings, allow_mismatch=options.allow_resume_data_mismatch, warn=self._is_main
            )
        if resume is not None and self._is_main:
            logger.warning("resuming from %s", resume)
        return resume

    def _outcome(self, exc: BaseException) -> BaseException:
        """What leaves ``train()`` for ``exc``: a collective's failure named (``collective_timeout`` / ``peer_lost``),
        or ``Preempted`` when a stop signal came first (before the loop, or a failure it caused)."""
        absent: list[int] | None = []
        if isinstance(exc, RuntimeError):
            roll_call, hosts = self._roll_call, [view.host for view in self.views]

            def lost() -> str:
                nonlocal absent
                absent = roll_call.absent() if roll_call is not None else []
                return describe_lost(absent, hosts)

            failure = collective_failure(
                exc,
                timeout_s=self.options.ddp_timeout,
                rank=self.options.rank,
                lost=None if roll_call is None else lost,
            )
            exc = exc if failure is None else failure
            if isinstance(failure, RunError) and failure.reason_code == "peer_lost" and absent != []:
                return (
                    failure  # ranks are gone (a killed node): a launcher's SIGTERM after it is teardown, not preemption
                )
        outcome = self.preemption.outcome(exc)
        if isinstance(outcome, Preempted) and not isinstance(outcome, TrainingPreempted) and self.preemption.received:
            stop_process_group()
            marker = {"phase": self.preemption.stopped_during, "signal": self.preemption.signal_name}
            announce(outcome, self._output_dir, marker=marker)
        return outcome if outcome is not None else exc

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
        name = handler.agreed_signal_name  # the marker names the signal whichever rank received it
        checkpoint = str(self._checkpoint_dir(trainer))
        where = "" if handler.received is not None else " on another rank"
        preempted = TrainingPreempted(handler.stop_step, checkpoint, name + where)
        end_process_group()  # the process exits with 75 next; a live gloo group can turn that into an abort
        marker = {"phase": "training", "signal": name, "step": handler.stop_step, "checkpoint": checkpoint}
        announce(preempted, self._output_dir, marker=marker if self._is_main else None)
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
        self.guard.abandon_newer_checkpoints()  # the resumed checkpoint passed every check and is loaded
        self.guard.preemption.start_recording()  # the loop: finish the step, agree, save
        if args.process_index == 0:  # training starts: an earlier preemption is over (a launch that fails before
            clear_marker(self.guard.options.output_dir)  # this leaves its marker, the requeue's only sign of it)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        handler = self.guard.preemption
        if handler.stop_step is None and handler.agree():
            handler.stop_step = state.global_step
            control.should_save = True
            control.should_training_stop = True
            if args.process_index == 0:
                logger.warning("stop signal: stopping after step %d and saving a checkpoint", state.global_step)
        return control
