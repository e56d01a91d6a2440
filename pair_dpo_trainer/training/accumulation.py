"""A variable number of micro-batches per optimizer step, under plain PyTorch, DDP and DeepSpeed ZeRO.

With a token budget, HF Trainer sees one DataLoader item per optimizer step (a :class:`StepBatch`, see
:mod:`pair_dpo_trainer.collators.step`) and runs with ``gradient_accumulation_steps=1``: it calls ``training_step``
once per step, then clips, steps the optimizer and the LR scheduler and counts ``global_step``, exactly as it does
for one micro-batch. :func:`run_step` is that ``training_step``: it runs the item's micro-batches one after the other
through HF's own micro-batch ``training_step`` (forward, loss, ``accelerator.backward``) and controls when gradients
are synchronised, as HF's inner loop does for its fixed count:

* accelerate's ``GradientState.sync_gradients`` is False for every micro-batch but the last (HF sets it per item;
  here it is set per micro-batch);
* DDP: every micro-batch but the last runs inside ``accelerator.no_sync(model)``, so the gradient all-reduce happens
  once, in the last backward;
* DeepSpeed: the engine's gradient-accumulation boundary is set explicitly before each micro-batch
  (``engine.set_gradient_accumulation_boundary(last)``; accelerate's wrapper sets the same value again at
  ``backward``), so DeepSpeed's own micro-step counter (``gradient_accumulation_steps=1`` in its config) never
  decides: the engine reduces its accumulated gradients and steps only after the last micro-batch. Under ZeRO-3 each
  micro-batch's forward and backward gather parameters on every rank, which is why all ranks of a step run the same
  count (the planner's ``M_step``).

The loss scale is unchanged: each micro-batch returns ``world_size * sum(losses) / N`` with ``N`` the step's global
pair count (``compute_loss``), so the accumulated gradient is that of the mean loss over the step's pairs for any
budget, layout and count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from accelerate.utils import DistributedType

from pair_dpo_trainer.collators.packed import PackedPairBatch
from pair_dpo_trainer.collators.step import StepBatch

__all__ = ["microbatch_sync", "run_step"]


def microbatch_sync(accelerator: Any, model: Any, *, last: bool) -> contextlib.AbstractContextManager:
    """Sets up gradient synchronisation for one micro-batch of a step; returns the context to run it in.

    Args:
        accelerator: The Trainer's ``Accelerator``.
        model: The model ``training_step`` got (DDP / DeepSpeed engine / plain module).
        last: Whether this is the step's last micro-batch (the one whose backward synchronises gradients).
    """
    accelerator.gradient_state._set_sync_gradients(last)  # what HF's inner loop sets per item
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        model.set_gradient_accumulation_boundary(last)
        return contextlib.nullcontext()
    if last or accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False):
        return contextlib.nullcontext()
    return accelerator.no_sync(model=model)


def run_step(
    step: StepBatch,
    *,
    accelerator: Any,
    model: torch.nn.Module,
    microbatch_step: Callable[[PackedPairBatch], torch.Tensor],
) -> torch.Tensor:
    """Runs every micro-batch of ``step`` (forward + backward) with gradients synchronised after the last only.

    Args:
        step: One rank's micro-batches of one optimizer step.
        accelerator: The Trainer's ``Accelerator``.
        model: The model ``training_step`` got.
        microbatch_step: Forward + backward of one micro-batch, returning its detached loss (HF's
            ``training_step`` on a :class:`PackedPairBatch`).

    Returns:
        The sum of the micro-batches' losses (0-d, detached): with the loss scale of ``compute_loss``, this rank's
        share of the step's mean loss, which HF accumulates and averages over ranks for logging.
    """
    total: torch.Tensor | None = None
    for index, microbatch in enumerate(step.microbatches):
        with microbatch_sync(accelerator, model, last=index == len(step) - 1):
            loss = microbatch_step(microbatch)
        total = loss if total is None else total + loss
    assert total is not None, "a StepBatch holds at least one micro-batch"
    return total
