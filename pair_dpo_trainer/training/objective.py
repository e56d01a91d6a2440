"""The objective during a run: what the trainer calls per micro-batch, per optimizer step and per checkpoint.

:class:`ObjectiveRuntime` owns the run's :class:`~pair_dpo_trainer.losses.objective.Objective`, BCO's running reward
mean and the step-context builder; :class:`StepBoundaryCallback` folds the state at every optimizer-step boundary
and triggers TR-DPO's reference sync (``sync_ref_model``), both on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from transformers import TrainerCallback

from pair_dpo_trainer.collators.batch import PackedPairBatch
from pair_dpo_trainer.collators.step import StepBatch
from pair_dpo_trainer.config.sections import ObjectiveOptions
from pair_dpo_trainer.errors import ConfigError
from pair_dpo_trainer.losses.base import LossParams, PairLogps, StepContext
from pair_dpo_trainer.losses.objective import Objective, ObjectiveOutput
from pair_dpo_trainer.training.objective_state import RunningRewardMean, read_objective_state, write_objective_state
from pair_dpo_trainer.training.step_context import MarginsFn, StepContextBuilder


class ObjectiveRuntime:
    """The run's objective with its state.

    Args:
        objective: The run's objective section (the objectives, their weights, WPO's weighting).
        params: The objectives' hyper-parameters (``training.options.loss_params``).
        device: The training device.
    """

    def __init__(self, objective: ObjectiveOptions, params: LossParams, device: torch.device) -> None:
        self.params = params
        weights = None if objective.loss_weights is None else list(objective.loss_weights)
        self.objective = Objective(list(objective.loss_type), weights, params, use_weighting=objective.use_weighting)
        self.bco_state = RunningRewardMean(device) if self.objective.needs("stateful") else None
        self.contexts = StepContextBuilder(self.objective, self.bco_state)
        self.device = device

    @property
    def needs_step_context(self) -> bool:
        """True when some component reads quantities of the whole optimizer step."""
        return self.contexts.active

    @property
    def sorts_step(self) -> bool:
        """True when the step runs AOT's gradient-free pre-pass (one more policy and reference forward)."""
        return self.contexts.sorts_step

    def attach_step_contexts(
        self, items: Sequence[PackedPairBatch | StepBatch], *, margins_fn: MarginsFn, pairs_per_rank: int
    ) -> list[PackedPairBatch | StepBatch]:
        """The step's host items (the Trainer's accumulation micro-batches, or one token-budget ``StepBatch``), each
        micro-batch carrying its :class:`StepContext` (a collective: every rank)."""
        if not self.needs_step_context or not items:
            return list(items)
        groups = [item.microbatches if isinstance(item, StepBatch) else (item,) for item in items]
        batches = [batch for group in groups for batch in group]
        margins = margins_fn if self.sorts_step else None
        contexts = iter(self.contexts.for_step(batches, self.device, margins_fn=margins, pairs_per_rank=pairs_per_rank))
        attached = [tuple(batch.with_step_context(next(contexts)) for batch in group) for group in groups]
        return [
            StepBatch(group) if isinstance(item, StepBatch) else group[0]
            for item, group in zip(items, attached, strict=True)
        ]

    def __call__(self, logps: PairLogps, batch: PackedPairBatch, *, training: bool) -> ObjectiveOutput:
        """Per-pair losses of one micro-batch; a training micro-batch also feeds BCO's pending reward sums."""
        context = batch.step_context
        if context is None:
            context = self.contexts.for_microbatch(logps, batch.pair_weights) if self.needs_step_context else None
        output = self.objective(logps, context if context is not None else StepContext())
        if training and self.bco_state is not None:
            self.bco_state.observe(logps, self.params.beta)
        return output

    def end_step(self) -> None:
        """At an optimizer-step boundary (every rank): folds the pending state of this step."""
        if self.bco_state is not None:
            self.bco_state.fold()

    def state_dict(self) -> dict[str, Any]:
        """The state a checkpoint keeps (empty when no component is stateful)."""
        return {} if self.bco_state is None else {"bco_pair_shift": self.bco_state.state_dict()}

    def save(self, checkpoint_dir: str | os.PathLike[str]) -> None:
        """Writes the state into the checkpoint (nothing when no component is stateful)."""
        state = self.state_dict()
        if state:
            write_objective_state(checkpoint_dir, state)

    def resume(self, checkpoint_dir: str | os.PathLike[str]) -> None:
        """Restores the state of a checkpoint before training continues.

        Raises:
            ConfigError: ``objective_state_missing`` when a stateful objective's checkpoint has no state.
        """
        if self.bco_state is None:
            return
        data = read_objective_state(checkpoint_dir)
        if "bco_pair_shift" not in data:
            raise ConfigError(
                "objective_state_missing",
                f"{checkpoint_dir} has no bco_pair_shift state (it was written with another loss_type): resume with "
                "the loss_type it was trained with, or start a new run.",
            )
        self.bco_state.load_state_dict(data["bco_pair_shift"])


class StepBoundaryCallback(TrainerCallback):
    """At the end of every optimizer step (before logging and saving): folds the objective's state and, with
    ``sync_ref_model``, mixes the policy into the reference every ``ref_model_sync_steps`` steps (TR-DPO).

    Args:
        runtime: The run's :class:`ObjectiveRuntime`.
        reference_manager: The run's reference manager (``sync_with``; its ``options`` say when to sync).
    """

    def __init__(self, runtime: ObjectiveRuntime, reference_manager: Any) -> None:
        self.runtime = runtime
        self.reference_manager = reference_manager

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.runtime.end_step()
        sync = self.reference_manager.options
        if sync.sync_ref_model and state.global_step % sync.ref_model_sync_steps == 0:
            self.reference_manager.sync_with(model, step=state.global_step)
