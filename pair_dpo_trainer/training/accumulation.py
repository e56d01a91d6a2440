"""A variable number of micro-batches per optimizer step, under plain PyTorch, DDP and DeepSpeed ZeRO.

With a token budget, HF Trainer sees one DataLoader item per optimizer step (a :class:`StepBatch`, see
:mod:`pair_dpo_trainer.collators.step`) and runs with ``gradient_accumulation_steps=1``: it calls ``training_step``
once per step, then clips, steps the optimizer and the LR scheduler and counts ``global_step``, exactly as it does
for one micro-batch. :func:`run_step` is that ``training_step``: it runs the item's micro-batches one after the other
through HF's own micro-batch ``training_step`` (forward, loss, ``accelerator.backward``) and controls when gradients
are synchronised, as HF's inner loop does for its fixed count:

Details: training/README.md, "Module notes", ``accumulation.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from accelerate.utils import DistributedType

from pair_dpo_trainer.collators.batch import PackedPairBatch
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


def step_normalized_loss(losses: torch.Tensor, *, world_size: int, global_pairs: int | None) -> torch.Tensor:
    """The micro-batch loss whose gradient, summed over the step's micro-batches and averaged over ranks by DDP /
    DeepSpeed, is the gradient of the mean loss over the step's ``N = global_pairs`` pairs: ``W * sum(losses) / N``
    (the Trainer does not divide by GA: ``loss_is_scaled_for_ga``). Evaluation (``global_pairs`` None) takes the
    micro-batch mean.

    Under sequence parallelism ``W`` is the data-parallel size (world / group size): the ``S`` ranks of a group hold
    the same pairs and each carries ``1 / S`` of their loss; the all-reduce of their per-sequence log-probs adds the
    ``S`` gradients in backward (``modeling.sequence_parallel``), and DDP / DeepSpeed's mean over all ``W * S`` ranks
    then gives the same gradient.

    Args:
        losses: ``[n]`` per-pair losses of the micro-batch.
        world_size: ``W``, the data-parallel ranks.
        global_pairs: ``N``, the pairs of the optimizer step over every rank and micro-batch (from the schedule).

    Example:
        >>> step_normalized_loss(torch.tensor([1.0, 3.0]), world_size=2, global_pairs=8).item()
        1.0
    """
    if global_pairs is None:
        return losses.mean()
    return losses.sum() * (world_size / global_pairs)


def assert_finite_losses(losses: torch.Tensor) -> None:
    """Fails the step on the device (no host sync) when a per-pair loss is NaN or inf."""
    torch._assert_async(
        torch.isfinite(losses).all(),
        "[non_finite] a DPO loss is NaN/inf: non-finite logits or log-probs in this micro-batch "
        "(check the learning rate, bf16 overflow, and the data).",
    )
