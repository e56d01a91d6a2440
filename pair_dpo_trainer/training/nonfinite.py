"""Optimizer steps whose gradient norm is NaN/inf are never applied; after ``max_nonfinite_grad_skips`` the run stops.

The decision reads the gradient norm the Trainer computes at every optimizer step (``Trainer._get_grad_norm``, after
the gradients are all-reduced: DDP averages them, FSDP2 and DeepSpeed ZeRO reduce the norm over the ranks), so every
rank reads the same norm and decides alike; one host read per optimizer step, none per micro-batch. The skip count is
compared across ranks at every checkpoint save (``ranks_disagree`` otherwise).

- Single process, DDP, FSDP2: the step's ``optimizer.step()`` is not called (a gate around the prepared optimizer's
  ``step``) and the gradients are dropped; the LR scheduler still steps and ``global_step`` still advances, so the
  learning rate and the data of every step stay functions of the step number alone (a resumed or a skip-free run
  reaches step ``k`` with the same learning rate and the same pairs).
- DeepSpeed (bf16 / fp32): the engine steps inside the last backward and its optimizer discards a step whose global
  norm is invalid (``overflow``); that skip is counted here the same way, and the LR scheduler, which neither the
  engine nor the Trainer steps after a discarded step, is stepped. A non-finite norm that DeepSpeed applied anyway
  stops the run at once.
- fp16: the loss scaler skips overflowing steps and lowers the scale by design; those steps are not counted.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import TrainerCallback

from pair_dpo_trainer.errors import RunError
from pair_dpo_trainer.parallel.agreement import assert_ranks_agree

logger = logging.getLogger(__name__)

SKIPS_METRIC = "nonfinite_grad_skips"
"""The logged count of the run's optimizer steps skipped for a non-finite gradient norm (resumes continue it)."""


@dataclass(frozen=True)
class EngineStep:
    """A DeepSpeed optimizer step, already taken (or discarded) by its engine inside the last backward.

    Attributes:
        applied: The engine applied the step (False: its optimizer's overflow skip discarded it).
        advance_schedule: Steps the engine's LR scheduler, which the engine skips on a discarded step.
    """

    applied: bool
    advance_schedule: Callable[[], None]


def deepspeed_engine_step(accelerator: Any, lr_scheduler: Any) -> EngineStep:
    """The step the DeepSpeed engine of ``accelerator`` just took (read after its ``engine.step()``).

    ``lr_scheduler``: the Trainer's; on a discarded step neither the engine (when it owns the scheduler) nor the Trainer
    (it checks ``optimizer_step_was_skipped``) steps it, so :meth:`EngineStep.advance_schedule` steps the scheduler
    that accelerate's wrapper holds, once. Metric-driven schedulers (``ReduceLROnPlateau``, ``GreedyLR``) step on
    evaluations, not here."""
    scheduler = getattr(lr_scheduler, "scheduler", lr_scheduler)
    per_metric = (torch.optim.lr_scheduler.ReduceLROnPlateau, *_greedy_lr())

    def advance_schedule() -> None:
        if scheduler is not None and not isinstance(scheduler, per_metric):
            scheduler.step()

    return EngineStep(applied=not accelerator.optimizer_step_was_skipped, advance_schedule=advance_schedule)


def _greedy_lr() -> tuple[type, ...]:
    from transformers import optimization

    greedy = getattr(optimization, "GreedyLR", None)  # in the transformers releases that have it
    return (greedy,) if isinstance(greedy, type) else ()


class NonFiniteStepGuard(TrainerCallback):
    """Skips the optimizer steps whose gradient norm is not finite, counts them, and stops the run past a limit.

    Args:
        limit: ``max_nonfinite_grad_skips``: how many steps the run may skip (checkpoints record the count and a
            resume continues it); the next non-finite norm raises ``nonfinite_gradients``.
        loss_scaled: fp16 with a dynamic loss scale: overflowing steps are the scaler's to skip (never counted).
    """

    def __init__(self, limit: int, *, loss_scaled: bool = False) -> None:
        self.limit = limit
        self.loss_scaled = loss_scaled
        self.skips = 0
        self._skip_next_step = False
        self._advance_schedule: Callable[[], None] | None = None

    def reset(self, skips: int = 0) -> None:
        """A ``train()`` call starts from the resumed checkpoint's count (``skips``; 0 on a fresh start)."""
        self.skips, self._skip_next_step, self._advance_schedule = skips, False, None

    def after_grad_norm(self, grad_norm: Any, optimizer: Any, *, step: int, engine_step: EngineStep | None) -> None:
        """Decides the optimizer step of ``step`` from its gradient norm (a 0-d tensor or a float; one host read).

        Args:
            grad_norm: The global gradient norm of the step (before clipping).
            optimizer: The Trainer's (prepared) optimizer, whose ``step`` is gated.
            step: The 1-based number of the optimizer step being decided (messages only).
            engine_step: DeepSpeed: the step its engine already took or discarded (a discarded one is counted and
                its LR scheduler stepped); None when ``optimizer.step()`` is still to come.

        Raises:
            RunError: ``nonfinite_gradients`` once more than ``limit`` steps were skipped, or when DeepSpeed applied
                a step whose norm is not finite.
        """
        if self.loss_scaled or grad_norm is None:
            return
        norm = float(grad_norm)  # the one host read of the step (HF reads it again when it logs)
        if math.isfinite(norm):
            return
        if engine_step is not None and engine_step.applied:
            raise RunError(
                "nonfinite_gradients",
                f"step {step}: the gradient norm is {norm} and DeepSpeed applied the step anyway (its optimizer "
                "checks the norm only for some stages and precisions), so the weights are not finite. Resume from "
                "the last checkpoint (--resume_from_checkpoint latest) with a lower learning_rate or a "
                "max_grad_norm.",
            )
        self.skips += 1
        if engine_step is None:
            self._gate(optimizer)
            self._skip_next_step = True
            optimizer.zero_grad(set_to_none=True)
        else:
            self._advance_schedule = engine_step.advance_schedule  # at the step's end, after the Trainer read the LR
        if self.skips > self.limit:
            raise RunError(
                "nonfinite_gradients",
                f"step {step}: the gradient norm is {norm}, the run's non-finite norm number {self.skips}, more than "
                f"max_nonfinite_grad_skips={self.limit} allows (a resumed run continues its checkpoint's count). No "
                "skipped step was applied: the weights are the last applied step's and the checkpoints are intact. "
                "Resume the last one, or an earlier one (--resume_from_checkpoint <output_dir>/checkpoint-N), with a "
                "lower learning_rate, a max_grad_norm or a warmup and a higher max_nonfinite_grad_skips, or check the "
                "data of these steps.",
            )
        logger.warning(
            "step %d: the gradient norm is %s: the optimizer step is skipped (%d of max_nonfinite_grad_skips=%d)",
            step,
            norm,
            self.skips,
            self.limit,
        )

    def on_step_end(self, args, state, control, **kwargs):
        """A step DeepSpeed discarded: its LR scheduler steps now, as after an applied step."""
        advance, self._advance_schedule = self._advance_schedule, None
        if advance is not None:
            advance()
        return control

    def check_ranks_agree(self) -> None:
        """Every rank skipped the same steps (a collective: every rank calls it, at each checkpoint save)."""
        assert_ranks_agree("count of skipped non-finite gradient steps", str(self.skips))

    def _gate(self, optimizer: Any) -> None:
        """Wraps ``optimizer.step`` once so that a step marked for skipping is not taken."""
        if getattr(optimizer, "_pair_dpo_step_guard", None) is self:
            return
        step = optimizer.step

        def gated_step(*args: Any, **kwargs: Any) -> Any:
            if self._skip_next_step:
                self._skip_next_step = False
                return None
            return step(*args, **kwargs)

        optimizer.step = gated_step
        optimizer._pair_dpo_step_guard = self
