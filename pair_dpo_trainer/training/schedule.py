"""The train schedule of a run: the pair-atomic sampler its config asks for (a fixed micro-batch count or a token
budget), on this rank."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pair_dpo_trainer.config.sections import ScheduleOptions
from pair_dpo_trainer.errors import ConfigError
from pair_dpo_trainer.samplers import PairBatchSampler, PairStepSampler
from pair_dpo_trainer.samplers.evaluation import EvalBatchSampler
from pair_dpo_trainer.samplers.planner import check_enough_pairs


def train_sampler(costs: Sequence[int], schedule: ScheduleOptions) -> PairBatchSampler | PairStepSampler:
    """This rank's train sampler: micro-batches of a fixed count (HF's accumulation groups them), or whole steps
    when ``max_tokens_per_microbatch`` is set.

    Args:
        costs: ``[N]`` pair costs of the train dataset.
        schedule: The run's schedule section (layout, seed / data_seed, budget).
    """
    layout = {
        "world_size": schedule.world_size,
        "rank": schedule.rank,
        "pairs_per_rank": schedule.pairs_per_rank,
        "seed": schedule.seed,
    }
    if schedule.max_tokens_per_microbatch is None:
        return PairBatchSampler(costs, microbatches=schedule.microbatches, **layout)
    return PairStepSampler(costs, max_tokens_per_microbatch=schedule.max_tokens_per_microbatch, **layout)


def eval_sampler(costs: Sequence[int], schedule: ScheduleOptions) -> EvalBatchSampler:
    """This rank's eval sampler: every eval pair once, ``per_device_eval_batch_size`` pairs (within the token budget
    when one is set) per micro-batch, equal micro-batch counts on all ranks (``samplers.evaluation``)."""
    return EvalBatchSampler(
        costs,
        world_size=schedule.world_size,
        rank=schedule.rank,
        pairs_per_microbatch=schedule.eval_pairs_per_microbatch,
        max_tokens_per_microbatch=schedule.max_tokens_per_microbatch,
    )


def check_train_rows(dataset: Any, schedule: ScheduleOptions) -> None:
    """Raises ``too_few_pairs`` when the train dataset has fewer rows than one optimizer step's pairs: checked from
    the row count alone, before the model loads and the rows are tokenised (rejected rows can only lower the count;
    the planner checks the tokenised pairs again).

    Raises:
        ScheduleError: ``too_few_pairs``.
    """
    if dataset is None or isinstance(dataset, Mapping) or not hasattr(dataset, "__len__"):
        return
    check_enough_pairs(
        len(dataset), world_size=schedule.world_size, pairs_per_rank=schedule.pairs_per_rank, rows="rows"
    )


def check_eval_requested(eval_dataset: Any, *, eval_strategy: Any, eval_on_start: bool) -> None:
    """Raises ``no_eval_dataset`` when ``train()`` is set to evaluate (``eval_strategy`` other than ``no``, or
    ``eval_on_start``) and there is no eval dataset: checked when the trainer is built, before anything loads, instead
    of the Trainer's plain ``ValueError`` (``eval_strategy``) or a crash at step 0 (``eval_on_start``, unchecked).

    Example:
        >>> check_eval_requested(None, eval_strategy="no", eval_on_start=False)
        >>> check_eval_requested(None, eval_strategy="no", eval_on_start=True)
        Traceback (most recent call last):
        ...
        pair_dpo_trainer.errors.ConfigError: [no_eval_dataset] eval_on_start=True evaluates during train(), ...
    """
    strategy = str(getattr(eval_strategy, "value", eval_strategy))
    asked = [f"eval_strategy={strategy!r}"] if strategy != "no" else []
    asked += ["eval_on_start=True"] if eval_on_start else []
    if eval_dataset is None and asked:
        raise ConfigError(
            "no_eval_dataset",
            f"{' and '.join(asked)} evaluates during train(), but no eval_dataset was given: pass eval_dataset "
            "(train.py: --eval_size N > 0, or a prepared directory with eval pairs), or set eval_strategy='no' and "
            "eval_on_start=False.",
        )
