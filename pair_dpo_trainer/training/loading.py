"""What the trainer loads: before the ``Trainer`` exists, the checks that need no model, the policy (after its
reference source is resolved and verified) wrapped in PEFT adapters, and the tokenised pairs of each dataset; then the
pairs' DataLoader (``PairDataLoader``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

from pair_dpo_trainer.collators.packed import PackedPairCollator
from pair_dpo_trainer.config.sections import BatchLimits, DataOptions, LayerOptions, ReferenceOptions, ScheduleOptions
from pair_dpo_trainer.data.dataset import pair_dataset_and_rendering
from pair_dpo_trainer.data.workers import resolve_num_proc
from pair_dpo_trainer.errors import PreferenceRowError
from pair_dpo_trainer.fault_tolerance.workers import StopSafeDataLoader
from pair_dpo_trainer.losses.registry import scores_chosen_prompts
from pair_dpo_trainer.modeling.float8 import fp8_pad_multiple
from pair_dpo_trainer.modeling.paths import require_model_directory
from pair_dpo_trainer.modeling.peft import wrap_with_peft
from pair_dpo_trainer.parallel.node import Node
from pair_dpo_trainer.parallel.zero3 import ensure_deepspeed_comm
from pair_dpo_trainer.reference.source import ReferenceSource, resolve_reference_source
from pair_dpo_trainer.training.schedule import check_eval_requested


class PairDataLoader(StopSafeDataLoader):
    """A DataLoader that forwards ``set_epoch`` to its pair batch sampler (the Trainer calls it each epoch); its workers
    survive a stop signal meant for the job (``fault_tolerance.workers``)."""

    def set_epoch(self, epoch: int) -> None:
        sampler: Any = self.batch_sampler
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)


def check_before_loading(model: Any, eval_dataset: Any, *, eval_strategy: Any, eval_on_start: bool) -> None:
    """What needs no model (the limits are settled before: ``training.options.settle_prepared_limits``): an
    evaluation asked of ``train()`` has an eval dataset (``no_eval_dataset``, an option problem: before any path is
    looked at) and the policy path exists (checked before the train rows: a mistyped path is not reported as too
    few pairs, ``training.schedule.check_train_rows``)."""
    check_eval_requested(eval_dataset, eval_strategy=eval_strategy, eval_on_start=eval_on_start)
    if isinstance(model, (str, Path)):
        require_model_directory(str(model), role="policy", option="model", code="model_not_found")


def with_peft(model: PreTrainedModel, peft_config: Any, gradient_checkpointing: bool, seed: int) -> PreTrainedModel:
    """The policy wrapped in ``peft_config``'s adapters, as TRL wraps it (``modeling.peft.wrap_with_peft``)."""
    checkpointing, zero3 = bool(gradient_checkpointing), is_deepspeed_zero3_enabled()
    wrapped = wrap_with_peft(model, peft_config, gradient_checkpointing=checkpointing, zero3=zero3, seed=seed)
    return cast(PreTrainedModel, wrapped)


def load_policy(
    model: PreTrainedModel | str, reference: ReferenceOptions, node: Node, *, ref_model_given: bool
) -> tuple[PreTrainedModel, str | None, ReferenceSource | None]:
    """Resolves (and verifies) the reference source BEFORE any weight is loaded, then loads a policy given by path.

    Returns:
        ``(policy, policy_dir, reference_source)``: ``policy_dir`` is the directory the policy was loaded
        from (None when passed in memory).
    """
    policy_dir = str(model) if isinstance(model, (str, Path)) else None
    if policy_dir is not None:  # named as the policy, before the reference (by default this path) is looked at
        require_model_directory(policy_dir, role="policy", option="model", code="model_not_found")
    reference_source = resolve_reference_source(
        reference,
        node,
        policy_dir=policy_dir,
        policy_name_or_path=getattr(model, "name_or_path", None),
        ref_model_given=ref_model_given,
    )
    if isinstance(model, PreTrainedModel) or policy_dir is None:
        return cast(PreTrainedModel, model), policy_dir, reference_source  # a model object (PEFT models too)
    ensure_deepspeed_comm()  # ZeRO-3 via TrainingArguments.deepspeed: from_pretrained runs under zero.Init
    return AutoModelForCausalLM.from_pretrained(policy_dir, trust_remote_code=False), policy_dir, reference_source


def tokenized_pairs(
    dataset: Any,
    tokenizer: Any,
    limits: BatchLimits,
    data: DataOptions,
    node: Node,
    *,
    desc: str,
    vocab_size: int,
    share_prompt: bool = False,
) -> tuple[Any, dict[str, str]]:
    """The tokenised pairs of one dataset argument, their ids within the model's ``vocab_size`` embedding rows, and
    how its rows were rendered (``data.dataset.pair_dataset_and_rendering``); the token budget admits each pair by
    its cost in the run's packed layout (``share_prompt``), against the row a sequence-parallel group holds.

    Raises:
        PreferenceRowError: as ``pair_dataset_and_rendering``; under sequence parallelism ``pair_too_long`` names the
            per-rank budget and the group size that make the row's limit.
    """
    try:
        return pair_dataset_and_rendering(
            dataset,
            tokenizer,
            max_length=limits.max_length,
            max_prompt_length=limits.max_prompt_length,
            max_tokens_per_microbatch=limits.row_token_budget,
            share_prompt=share_prompt,
            progress=data.progress,  # shown by the process that converts (the node's local main)
            desc=desc,
            num_proc=resolve_num_proc(data.num_proc),
            cache_dir=data.cache_dir,
            once=node.once,  # tokenised by each node's local main, memory-mapped by the others
            apply_chat_template_to_strings=data.apply_chat_template_to_strings,
            vocab_size=vocab_size,
        )
    except PreferenceRowError as exc:
        if exc.reason_code != "pair_too_long" or limits.sequence_parallel_size == 1:
            raise
        note = (
            f" The row of a sequence-parallel group holds max_tokens_per_microbatch={limits.max_tokens_per_microbatch} "
            f"tokens per rank x sequence_parallel_size={limits.sequence_parallel_size} = {limits.row_token_budget}: "
            "raise either, or shorten the pair."
        )
        raise PreferenceRowError("pair_too_long", exc.message + note) from exc


def pair_collator(
    limits: BatchLimits,
    layers: LayerOptions,
    schedule: ScheduleOptions,
    loss_type: Sequence[str],
    *,
    pad_token_id: int,
    share_prompt: bool,
) -> PackedPairCollator:
    """The run's packing collator: the layout (``share_prompt``), the pad rule (the row's budget with
    ``pad_to_budget``, else float8's multiple), ORPO's prompt positions and this rank's slice of each row under
    sequence parallelism."""
    return PackedPairCollator(
        pad_token_id=pad_token_id,
        pad_to_length=limits.row_token_budget if limits.pad_to_budget else None,
        pad_to_multiple_of=None if limits.pad_to_budget else fp8_pad_multiple(layers.fp8),
        score_chosen_prompts=scores_chosen_prompts(loss_type),  # ORPO's NLL covers the prompt
        share_prompt=share_prompt,
        sequence_shard=schedule.sequence_shard,
    )
