"""The run's option sections, built once from the ``PairDPOConfig``: every feature receives the section it reads.

The sections are ``config.sections``' frozen dataclasses plus the features' own (``LossParams``, ``GuardOptions``,
``Node``); this module is where a decision that needs a feature's knowledge is made for all of them (whether the run
has a reference: the objective table of ``losses.registry``). The trainer builds :class:`RunOptions` once the
config is settled (:func:`settle_prepared_limits`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pair_dpo_trainer.config import PairDPOConfig
from pair_dpo_trainer.config.sections import (
    BatchLimits,
    DataOptions,
    FsdpOptions,
    LayerOptions,
    ObjectiveOptions,
    ReferenceOptions,
    ScheduleOptions,
)
from pair_dpo_trainer.data.dataset import prepared_limits
from pair_dpo_trainer.fault_tolerance.guard import GuardOptions
from pair_dpo_trainer.losses.base import LossParams
from pair_dpo_trainer.losses.registry import no_reference_reason, uses_reference
from pair_dpo_trainer.parallel.node import Node
from pair_dpo_trainer.training.loading import check_before_loading
from pair_dpo_trainer.training.schedule import check_train_rows

logger = logging.getLogger(__name__)


def reference_options(args: PairDPOConfig) -> ReferenceOptions:
    """The reference section, with the one decision of whether the run has a reference.

    Example:
        >>> reference_options(PairDPOConfig(output_dir="out", loss_type=["orpo"])).uses_reference
        False
    """
    uses = uses_reference(args.loss_type, reference_free=args.reference_free)
    reason = None if uses else no_reference_reason(args.loss_type, reference_free=args.reference_free)
    return ReferenceOptions.from_config(args, uses_reference=uses, no_reference_reason=reason)


def loss_params(args: PairDPOConfig) -> LossParams:
    """The objectives' hyper-parameters, as the pure loss functions take them.

    Example:
        >>> loss_params(PairDPOConfig(output_dir="out", beta=0.2)).beta
        0.2
    """
    return LossParams(
        beta=float(args.beta),
        label_smoothing=float(args.label_smoothing),
        nll_weight=float(args.nll_weight),
        f_divergence_type=args.f_divergence_type,
        f_alpha_divergence_coef=float(args.f_alpha_divergence_coef),
        discopop_tau=float(args.discopop_tau),
        simpo_gamma=float(args.simpo_gamma),
    )


def node_of(args: Any) -> Node:
    """This process's node, from a ``TrainingArguments`` process (its ranks, world size and ``ddp_timeout``)."""
    return Node(
        node_id=args.process_index - args.local_process_index,
        is_local_main=args.local_process_index == 0,
        world_size=args.world_size,
        stall_timeout=float(args.ddp_timeout),
    )


def guard_options(args: Any, resume_settings: Mapping[str, Any] | None = None) -> GuardOptions:
    """What fault tolerance reads of a run's ``TrainingArguments`` (a ``PairDPOConfig`` also sets the resume
    override), read when a ``train()`` session starts."""
    return GuardOptions(
        output_dir=str(args.output_dir),
        ddp_timeout=float(args.ddp_timeout),
        rank=int(args.process_index),
        allow_resume_data_mismatch=bool(getattr(args, "allow_resume_data_mismatch", False)),
        node_id=int(args.process_index - args.local_process_index),
        local_main=args.local_process_index == 0,
        save_on_each_node=bool(args.save_on_each_node),
        resume_settings=resume_settings,
    )


def settle_prepared_limits(args: PairDPOConfig, datasets: Sequence[Any]) -> None:
    """A prepared dataset's limits replace default ones (the user set neither), before any section reads them."""
    limits = prepared_limits(list(datasets))
    if limits is not None and not args.limits_given():
        args.max_length, args.max_prompt_length = limits
        logger.info("max_length=%d, max_prompt_length=%d: the prepared dataset's limits", *limits)


@dataclass(frozen=True)
class RunOptions:
    """Every section of one run (built by :func:`run_options`); the trainer hands each feature its own."""

    reference: ReferenceOptions
    objective: ObjectiveOptions
    layers: LayerOptions
    limits: BatchLimits
    schedule: ScheduleOptions
    data: DataOptions
    fsdp: FsdpOptions
    loss: LossParams
    node: Node


def options_before_loading(model: Any, args: PairDPOConfig, train_dataset: Any, eval_dataset: Any) -> RunOptions:
    """``PairDPOTrainer.__init__``'s first steps: a prepared dataset's limits settled, the checks that need no model
    (``training.loading.check_before_loading``), the sections built, then ``too_few_pairs`` from the row count."""
    settle_prepared_limits(args, [train_dataset, eval_dataset])  # before any section reads the limits
    check_before_loading(model, eval_dataset, eval_strategy=args.eval_strategy, eval_on_start=args.eval_on_start)
    options = run_options(args)
    check_train_rows(train_dataset, options.schedule)
    return options


def run_options(args: PairDPOConfig) -> RunOptions:
    """The run's sections, each read once from ``args``."""
    return RunOptions(
        reference=reference_options(args),
        objective=ObjectiveOptions.from_config(args),
        layers=LayerOptions.from_config(args),
        limits=BatchLimits.from_config(args),
        schedule=ScheduleOptions.from_config(args),
        data=DataOptions.from_config(args),
        fsdp=FsdpOptions.from_config(args),
        loss=loss_params(args),
        node=node_of(args),
    )
