"""Optimizer steps whose gradient norm is NaN/inf are never applied; after ``max_nonfinite_grad_skips`` the run stops.

The decision reads the gradient norm the Trainer computes at every optimizer step (``Trainer._get_grad_norm``, after
the gradients are all-reduced: DDP averages them, FSDP2 and DeepSpeed ZeRO reduce the norm over the ranks), so every
rank reads the same norm and decides alike; one host read per optimizer step, none per micro-batch. The skip count is
compared across ranks at every checkpoint save (``ranks_disagree`` otherwise).

- Single process, DDP, FSDP2: the step's ``optimizer.step()`` is not called (a gate around the prepared optimizer's
  ``step``) and the gradients are dropped; the LR scheduler still steps and ``global_step`` still advances, so the
  learning rate and the data of every step stay functions of the step number alone (a resumed or a skip-free run
  reaches step ``k`` with the same learning rate and the same pairs).
- DeepSpeed (bf16 / fp32): its optimizer already discards a step whose global norm is invalid (``overflow``); that
  skip is counted here the same way. A non-finite norm that DeepSpeed applied anyway stops the run at once.
- fp16: the loss scaler skips overflowing steps and lowers the scale by design; those steps are not counted.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from pair_dpo_trainer.errors import RunError
from pair_dpo_trainer.parallel.agreement import assert_ranks_agree

logger = logging.getLogger(__name__)

SKIPS_METRIC = "nonfinite_grad_skips"
"""The logged count of the run's optimizer steps skipped for a non-finite gradient norm (resumes continue it)."""


class NonFiniteStepGuard:
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

    def reset(self, skips: int = 0) -> None:
        """A ``train()`` call starts from the resumed checkpoint's count (``skips``; 0 on a fresh start)."""
        self.skips, self._skip_next_step = skips, False

    def after_grad_norm(self, grad_norm: Any, optimizer: Any, *, step: int, applied_by_backend: bool | None) -> None:
        """Decides the optimizer step of ``step`` from its gradient norm (a 0-d tensor or a float; one host read).

        Args:
            grad_norm: The global gradient norm of the step (before clipping).
            optimizer: The Trainer's (prepared) optimizer, whose ``step`` is gated.
            step: The 1-based number of the optimizer step being decided (messages only).
            applied_by_backend: DeepSpeed: whether its engine already applied the step (False: its own overflow
                skip); None when ``optimizer.step()`` is still to come.

        Raises:
            RunError: ``nonfinite_gradients`` once more than ``limit`` steps were skipped, or when DeepSpeed applied
                a step whose norm is not finite.
        """
        if self.loss_scaled or grad_norm is None:
            return
        norm = float(grad_norm)  # the one host read of the step (HF reads it again when it logs)
        if math.isfinite(norm):
            return
        if applied_by_backend:
            raise RunError(
                "nonfinite_gradients",
                f"step {step}: the gradient norm is {norm} and DeepSpeed applied the step anyway (its optimizer "
                "checks the norm only for some stages and precisions), so the weights are not finite. Resume from "
                "the last checkpoint (--resume_from_checkpoint latest) with a lower learning_rate or a "
                "max_grad_norm.",
            )
        self.skips += 1
        if applied_by_backend is None:
            self._gate(optimizer)
            self._skip_next_step = True
            optimizer.zero_grad(set_to_none=True)
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
