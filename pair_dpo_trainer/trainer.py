"""``PairDPOTrainer``: a ``transformers.Trainer`` that orchestrates pair DPO and holds no maths.

One optimizer step on every rank: ``gradient_accumulation_steps`` packed micro-batches from the pair-atomic sampler,
each through the policy and the frozen reference, per-pair losses from :mod:`pair_dpo_trainer.losses`, summed and
normalised by the GLOBAL pair count ``N`` of the step.

Loss scale: the Trainer does not divide by GA (``loss_is_scaled_for_ga = True``) and DDP / DeepSpeed average
gradients over the ``W`` ranks, so each micro-batch returns ``W * sum(losses) / N``; the gradient is then exactly the
gradient of the mean loss over the step's ``N`` pairs, whatever the (DP, GA) layout. ``N`` comes from the
deterministic schedule on the host: no collective, no GPU sync.

The reference (built at once, or lazily under DeepSpeed / ``precompute_ref_log_probs``; identified; checked on resume
before any checkpoint state is restored; precomputed and freed) is owned by
:class:`~pair_dpo_trainer.reference.manager.ReferenceManager`; the trainer only calls it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from torch.profiler import record_function
from torch.utils.data import DataLoader
from transformers import AutoTokenizer, PreTrainedModel, Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, EvalLoopOutput

from pair_dpo_trainer.collators.batch import PackedPairBatch
from pair_dpo_trainer.collators.packed import PackedPairCollator
from pair_dpo_trainer.collators.step import StepBatch, StepCollator, StepPairs
from pair_dpo_trainer.config import PairDPOConfig
from pair_dpo_trainer.config.sections import ScheduleOptions
from pair_dpo_trainer.config.trl_names import TRAINER_KWARG_EQUIVALENTS, reject_unsupported_options
from pair_dpo_trainer.data.dataset import pairs_digest
from pair_dpo_trainer.data.token_ids import input_vocab_size
from pair_dpo_trainer.errors import ConfigError, raise_problems
from pair_dpo_trainer.fault_tolerance import RunGuard
from pair_dpo_trainer.fault_tolerance.launcher import follow_launcher
from pair_dpo_trainer.fault_tolerance.preemption import stops_on_signal
from pair_dpo_trainer.fault_tolerance.workers import StopSafeDataLoader
from pair_dpo_trainer.losses import PairLogps
from pair_dpo_trainer.losses.length_weights import with_length_desensitization
from pair_dpo_trainer.modeling.attention import enable_pair_varlen, resolve_share_prompt
from pair_dpo_trainer.modeling.logprobs import packed_policy_logps
from pair_dpo_trainer.observability.flops import flops_per_token_per_parameter, non_embedding_parameters
from pair_dpo_trainer.observability.metrics import PairMetrics
from pair_dpo_trainer.observability.summary import (
    RunFacts,
    announce_node,
    announce_run,
    first_step_layout,
    precision_summary,
)
from pair_dpo_trainer.parallel.agreement import assert_ranks_agree
from pair_dpo_trainer.parallel.fsdp2 import (
    check_evaluable,
    check_fsdp_version,
    find_fsdp2_plugin,
    full_state_dict,
    setup_fsdp2,
)
from pair_dpo_trainer.parallel.sequence import apply_sequence_parallel
from pair_dpo_trainer.parallel.zero3 import zero3_leaf_setup
from pair_dpo_trainer.reference.base import Reference
from pair_dpo_trainer.reference.checks import adapter_disabled_reference, ignored_reference_settings
from pair_dpo_trainer.reference.manager import ReferenceManager
from pair_dpo_trainer.reference.peft import is_peft_model
from pair_dpo_trainer.samplers import PairBatchSampler, PairStepSampler
from pair_dpo_trainer.samplers.evaluation import WeightedPairs
from pair_dpo_trainer.training.accumulation import assert_finite_losses, run_step, step_normalized_loss
from pair_dpo_trainer.training.checks import RunSetup, check_config, run_problems
from pair_dpo_trainer.training.layers import Budget, Fp8ScaleCallback, LayerPlan, ProbeInputs, prepare_run_layers
from pair_dpo_trainer.training.loading import PairDataLoader, load_policy, pair_collator, tokenized_pairs, with_peft
from pair_dpo_trainer.training.nonfinite import SKIPS_METRIC, NonFiniteStepGuard, deepspeed_engine_step
from pair_dpo_trainer.training.objective import ObjectiveRuntime, StepBoundaryCallback
from pair_dpo_trainer.training.options import guard_options, options_before_loading
from pair_dpo_trainer.training.pair_logps import pair_logps_from_sequences
from pair_dpo_trainer.training.resume_settings import (
    base_learning_rates,
    keep_configured_cadence,
    keep_configured_learning_rates,
    resume_settings,
)
from pair_dpo_trainer.training.schedule import eval_sampler, train_sampler

logger = logging.getLogger(__name__)


class PairDPOTrainer(Trainer):
    """Pair DPO on the Hugging Face Trainer: change ``Trainer``/``TrainingArguments`` to
    ``PairDPOTrainer``/``PairDPOConfig`` and pass preference pairs as the datasets.

    Args:
        model: A causal LM, or the path of a local directory to load it from.
        args: The :class:`PairDPOConfig`.
        train_dataset / eval_dataset: Preference rows (any shape :func:`~pair_dpo_trainer.data.normalize.normalize_row`
            accepts) or already tokenised pairs (``prompt_input_ids`` / ``chosen_input_ids`` / ``rejected_input_ids``).
        processing_class: The tokenizer (loaded from the model path when omitted).
        ref_model: An explicit reference model (default: built from ``args``, see :mod:`pair_dpo_trainer.reference`);
            ignored (and named in the run summary) when the run builds no reference.
        peft_config: A ``peft.PeftConfig``: the policy is wrapped in its adapters as TRL does
            (:func:`~pair_dpo_trainer.modeling.peft.wrap_with_peft`); the reference is then the policy with its
            adapters disabled.
        **kwargs: Passed to ``transformers.Trainer`` (callbacks, optimizers, ...).

    A stop signal (SIGTERM, SIGINT) while the constructor loads and tokenises, in ``evaluate()`` or in ``train()``
    before its loop raises ``Preempted`` (exit code 75; temporary files removed); in the training loop the run
    finishes the step and saves first (``TrainingPreempted``); ``save_model`` finishes before it stops.
    """

    loss_is_scaled_for_ga = True
    worker_init_fn: Callable[[int], Any] | None = None
    """Run in each DataLoader worker after the trainer's own set-up (set it on the instance or a subclass)."""
    args: PairDPOConfig  # narrows the Trainer's TrainingArguments (checked in __init__)
    model: torch.nn.Module  # the policy (set by Trainer.__init__, never None here)

    @stops_on_signal("building the trainer (loading the model, tokenising the datasets)")
    def __init__(
        self,
        model: PreTrainedModel | str,
        args: PairDPOConfig,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        ref_model: PreTrainedModel | None = None,
        peft_config: Any = None,
        **kwargs: Any,
    ) -> None:
        reject_unsupported_options(kwargs, where="PairDPOTrainer", table=TRAINER_KWARG_EQUIVALENTS)
        self.args = args  # where a stop signal's marker goes (Trainer.__init__ sets it again)
        follow_launcher()
        if not isinstance(args, PairDPOConfig):
            raise ConfigError(
                "bad_args",
                f"PairDPOTrainer needs a PairDPOConfig as args (a TrainingArguments subclass), got "
                f"{type(args).__name__}; TRL's DPOTrainer(model, ref_model, args) order differs: pass keywords.",
            )
        check_config(args)  # every feature's option checks, before anything is loaded
        self.options = options = options_before_loading(model, args, train_dataset, eval_dataset)  # the sections
        self.ignored_reference = ignored_reference_settings(options.reference, ref_model_given=ref_model is not None)
        ref_model = None if self.ignored_reference else ref_model  # a reference-free run ignores it (summary)
        model, policy_dir, self.reference_source = load_policy(
            model, options.reference, options.node, ref_model_given=ref_model is not None
        )
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(policy_dir or model.name_or_path, trust_remote_code=False)
        if peft_config is not None:
            model = with_peft(model, peft_config, bool(args.gradient_checkpointing), args.seed)
        self.attn_backend = enable_pair_varlen(model, options.layers.attn_backend)
        self.share_prompt, self.unshared_reason = resolve_share_prompt(options.limits.share_prompt, model)  # layout
        self._given = {"peft_policy": is_peft_model(model), "ref_model_given": ref_model is not None}  # run_checks
        self.renderings: dict[str, str] = {}  # dataset -> how its rows became tokens (run summary)
        vocab = input_vocab_size(model)  # every token id of the pairs is checked against it
        train_pairs = self._pairs(train_dataset, processing_class, "train dataset", vocab)
        eval_pairs = self._pairs(eval_dataset, processing_class, "eval dataset", vocab)
        super().__init__(
            model=model,
            args=args,
            data_collator=pair_collator(  # type: ignore[arg-type]  # returns a PackedPairBatch, not a dict
                options.limits,
                options.layers,
                options.schedule,
                options.objective.loss_type,
                pad_token_id=processing_class.pad_token_id or 0,
                share_prompt=self.share_prompt,
            ),  # fmt: skip
            train_dataset=train_pairs,
            eval_dataset=eval_pairs,
            processing_class=processing_class,
            **kwargs,
        )
        self.model_accepts_loss_kwargs = True  # older transformers: keep the Trainer from dividing by GA
        self._set_up_run(model, ref_model)

    def _set_up_run(self, model: Any, ref_model: Any) -> None:
        """What ``__init__`` builds once HF's Trainer (and its Accelerator) exists: the sections that read the
        Accelerator's settings, sequence-parallel groups, ZeRO-3 leaves, the reference, the guards, the objective at
        run time and the metrics."""
        args = self.args
        # HF's create_accelerator_and_postprocess may take gradient_accumulation_steps from accelerator_config
        self.options = options = dataclasses.replace(self.options, schedule=ScheduleOptions.from_config(args))
        apply_sequence_parallel(model, options.layers.sequence_parallel_size)  # after run_problems checked the world
        ds_plugin = self.accelerator.state.deepspeed_plugin if self.is_deepspeed_enabled else None
        zero3 = ds_plugin is not None and ds_plugin.zero_stage == 3
        peft = is_peft_model(model)
        self.zero3_leaf_classes = zero3_leaf_setup(model, options.layers.zero3_leaf_modules, zero3=zero3, peft=peft)
        self.reference_manager = self._reference_manager(model, ref_model, ds_plugin)
        self.run_guard = RunGuard()  # output-dir lock, collective timeouts, preemption, atomic checkpoints
        self.step_guard = NonFiniteStepGuard(args.max_nonfinite_grad_skips, loss_scaled=bool(args.fp16))
        self.add_callback(self.step_guard)  # a step DeepSpeed discarded still steps the LR schedule
        self.objective_runtime = ObjectiveRuntime(options.objective, options.loss, args.device)  # BCO, step contexts
        self.add_callback(StepBoundaryCallback(self.objective_runtime, self.reference_manager))
        components = self.objective_runtime.objective.names
        self._metrics = {"train": PairMetrics(components), "eval": PairMetrics(components)}
        self._train_sampler: PairBatchSampler | PairStepSampler | None = None
        self._flop_params: int | None = None
        self.layer_plan: LayerPlan | None = None
        self._layers_trained = False
        self._layout_announced = False  # the first step's layout line (rank 0)
        if args.fp8 == "tensorwise" and self.fsdp_plugin is not None:
            self.add_callback(Fp8ScaleCallback(self.model))  # float8 all-gather: the next step's scales at once
        if args.torch_compile:  # the decoder layers compile in place (modeling.compile), never the whole model too
            from accelerate.utils import DynamoBackend

            self.accelerator.state.dynamo_plugin.backend = DynamoBackend.NO

    def _reference_manager(self, model: Any, ref_model: Any, ds_plugin: Any) -> ReferenceManager:
        """The run's reference manager: builds the reference now unless DeepSpeed / precompute (then lazily)."""
        options = self.options
        return ReferenceManager(
            options.reference,
            options.layers,
            model,
            source=self.reference_source,
            ref_model=ref_model,
            deepspeed_config=ds_plugin.deepspeed_config if ds_plugin is not None else None,
            limits=options.limits,
            schedule=options.schedule,
            data=options.data,
            device=self.args.device,
            should_save=self.args.should_save,
            mixed_precision=str(self.accelerator.mixed_precision),
            fsdp_plugin=self.fsdp_plugin,
            share_prompt=self.share_prompt,
        )

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's Accelerator, then FSDP2 as asked (``parallel.fsdp2.setup_fsdp2``): installed where Accelerate
        drops it (CPU processes), refused where unsupported (FSDP1), never a silent fallback to DDP."""
        check_fsdp_version(self.options.fsdp)
        super().create_accelerator_and_postprocess()
        raise_problems(run_problems(self.args, self._run_setup(), self.options))  # the one runtime check: all at once
        self.fsdp_plugin = setup_fsdp2(self.accelerator, self.options.fsdp)
        self.is_fsdp_enabled = self.fsdp_plugin is not None

    def _run_setup(self) -> RunSetup:
        """What the runtime checks read besides the config (``training.checks``), right after the Accelerator exists."""
        ds_plugin = self.accelerator.state.deepspeed_plugin if self.is_deepspeed_enabled else None
        return RunSetup(
            deepspeed_config=ds_plugin.deepspeed_config if ds_plugin is not None else None,
            fsdp_plugin=find_fsdp2_plugin(self.accelerator, self.options.fsdp),
            process_group=torch.distributed.is_available() and torch.distributed.is_initialized(),
            attn_backend=self.attn_backend,
            zero3=ds_plugin is not None and ds_plugin.zero_stage == 3,
            **self._given,
        )

    def _pairs(self, dataset: Any, tokenizer: Any, desc: str, vocab_size: int) -> Any:
        """The tokenised pairs of one dataset argument, their ids within the model's ``vocab_size`` embedding rows;
        records how its rows were rendered."""
        if dataset is None:
            return None
        options = self.options
        pairs, renderings = tokenized_pairs(
            dataset,
            tokenizer,
            options.limits,
            options.data,
            options.node,
            desc=desc,
            vocab_size=vocab_size,
            share_prompt=self.share_prompt,
        )
        self.renderings.update((name.removesuffix(" dataset"), rendering) for name, rendering in renderings.items())
        return pairs

    # ------------------------------------------------------------------ reference
    @property
    def reference(self) -> Reference:
        """The reference (``sequence_logps``), see :mod:`pair_dpo_trainer.reference.manager`."""
        return self.reference_manager.reference

    @property
    def reference_identity(self) -> Any:
        """The reference identity written beside every checkpoint (None when reference-free)."""
        return self.reference_manager.identity

    def train(  # type: ignore[override]  # the Trainer's keywords pass through **kwargs
        self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any
    ) -> Any:
        """``Trainer.train``, after the reference is ready: built (DeepSpeed: its own engine) or precomputed, and on
        resume proven to be the one the checkpoint was trained against, before any checkpoint state is restored.

        ``resume_from_checkpoint``: a checkpoint directory, or ``True`` / ``"latest"`` (the newest complete checkpoint
        of ``output_dir``) or ``"auto"`` (the same, or a fresh start when there is none). The run holds the lock of
        ``output_dir``, and a stop signal saves a checkpoint and raises ``TrainingPreempted`` (exit code 75): see
        :mod:`pair_dpo_trainer.fault_tolerance`.
        """
        settings = resume_settings(self.args, self.processing_class, share_prompt=self.share_prompt)
        options = guard_options(self.args, settings)  # as the arguments are when the session starts
        with self.run_guard.session(self, resume_from_checkpoint, options) as resume_from_checkpoint:
            self.step_guard.reset(self.run_guard.resumed_nonfinite_grad_skips())  # the run's count goes on
            self.reference_manager.prepare(self._reference_datasets(), resume_from_checkpoint)
            if resume_from_checkpoint:
                self.objective_runtime.resume(resume_from_checkpoint)  # BCO's running reward mean
            self._prepare_layers(training=True)
            if self.is_world_process_zero():
                announce_run(self.args, self._run_facts())
            node_ranks = self.run_guard.node_ranks()  # None on one node
            if node_ranks is not None and self.args.local_process_index == 0:
                announce_node(node_ranks, train_dataset=self.train_dataset, source=self.reference_source)
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def _run_facts(self) -> RunFacts:
        """What the run summary reports besides the config (``observability.summary``)."""
        parameter = next(self.model.parameters(), None)
        precision = precision_summary(
            str(self.accelerator.mixed_precision),
            device_type=self.args.device.type,
            param_dtype=None if parameter is None else parameter.dtype,
        )
        return RunFacts(
            attn_backend=self.attn_backend,
            source=self.reference_source,
            zero3_leaf_classes=self.zero3_leaf_classes,
            fsdp2=self.fsdp_plugin is not None,
            precision=precision,
            renderings=self.renderings,
            peft_reference=adapter_disabled_reference(self.options.reference, **self._given),
            ignored_reference=self.ignored_reference,
            layers=self.layer_plan,
            share_prompt=self.share_prompt,
            unshared_reason=self.unshared_reason,
        )

    @stops_on_signal("evaluation")
    def evaluate(self, eval_dataset: Any = None, *args: Any, **kwargs: Any) -> dict[str, float]:
        """``Trainer.evaluate`` after the reference is ready (a lazy or precomputed reference is prepared first)."""
        datasets = self._reference_datasets()
        if eval_dataset is not None and not isinstance(eval_dataset, str):
            datasets = {"eval": eval_dataset}
        self.reference_manager.prepare(datasets)
        self._prepare_layers(training=False)
        return super().evaluate(eval_dataset, *args, **kwargs)

    # ------------------------------------------------------------------ layers
    def _prepare_layers(self, *, training: bool) -> None:
        """Float8, activation checkpointing and compile of the policy's (and an in-process reference's) decoder
        layers, after the reference exists, so a reference copied from the policy is copied unconverted and
        uncompiled (``training.layers``). Idempotent; the checkpointing is decided at the first ``train()``."""
        if self._layers_trained or (self.layer_plan is not None and not training):
            return
        reference = self.reference_manager.reference_if_built
        self.layer_plan = prepare_run_layers(
            self.model,
            reference.model if reference is not None else None,
            self.options.layers,
            self.options.limits,
            training=training,
            probe_inputs=ProbeInputs(
                reference_logps=lambda batch: self.reference.sequence_logps(batch),  # built when the probe runs
                collator=cast(PackedPairCollator, self.data_collator),
                autocast=self.accelerator.autocast,
            ),
            fsdp=self.fsdp_plugin is not None,
            budget=Budget(self.options.limits.max_tokens_per_microbatch, self.args.device, self.args.world_size),
        )
        self._layers_trained = training

    def _reference_datasets(self) -> dict[str, Any]:
        """The datasets a precomputed reference covers: the train set and every eval set."""
        datasets = {"train": self.train_dataset}
        if isinstance(self.eval_dataset, dict):
            datasets.update({f"eval_{name}": dataset for name, dataset in self.eval_dataset.items()})
        else:
            datasets["eval"] = self.eval_dataset
        return datasets

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """``Trainer.create_scheduler``; remembers its base learning rates, which a resumed checkpoint would replace."""
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        self._configured_learning_rates = base_learning_rates(scheduler)
        return scheduler

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """``Trainer._load_optimizer_and_scheduler``; then this run's learning rate and logging / eval / save cadence
        apply again (the checkpoint's would otherwise win silently: ``training/resume_settings.py``)."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        configured = getattr(self, "_configured_learning_rates", None)
        changes = [
            keep_configured_learning_rates(self.lr_scheduler, configured),
            keep_configured_cadence(self.state, self.args),
        ]
        if self.is_world_process_zero() and any(changes):
            logger.warning("resumed with this run's %s", "; ".join(c for c in changes if c))

    @stops_on_signal("saving the model", defer=True)
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model``; under FSDP2 the final save (not a checkpoint's) always writes full weights, also
        when checkpoints are ``SHARDED_STATE_DICT`` (for which the Trainer's own final save writes none)."""
        if self.fsdp_plugin is None or _internal_call:
            return super().save_model(output_dir, _internal_call)
        with full_state_dict(self.fsdp_plugin):
            return super().save_model(output_dir, _internal_call)

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's save, made atomic with the reference identity inside (``fault_tolerance/checkpoint.py``);
        the TR-DPO
        synced reference and the objective's state are written into the staged directory with the Trainer's files.
        ``num_tokens`` is folded into the state first (it is in ``trainer_state.json``)."""
        self._metrics["train"].fold_tokens(self.args.device, self.state)
        self.step_guard.check_ranks_agree()
        identity = self.reference_manager.checkpoint_identity()  # every rank: re-identified after a TR-DPO sync
        save = functools.partial(super()._save_checkpoint, model, trial)

        def write() -> None:
            save()
            if self.args.should_save:  # inside the save, _get_output_dir points at the staging directory
                folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
                self.reference_manager.write_synced_weights(folder)
                self.objective_runtime.save(folder)

        skips = self.step_guard.skips
        self.run_guard.save_checkpoint(self, trial, write, identity=identity, nonfinite_grad_skips=skips)

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self) -> DataLoader:
        """One rank's pair-atomic schedule; deliberately not passed through ``accelerator.prepare`` (no re-sharding).

        With a token budget each item is a whole step (``collators.step``; the Trainer runs it as one accumulation
        step, see ``training.accumulation``)."""
        sampler = train_sampler(self._costs(self.train_dataset), self.options.schedule)
        fingerprint = sampler.schedule_fingerprint(0)
        assert_ranks_agree("train schedule", fingerprint)
        assert_ranks_agree("train pairs (a digest of their token ids)", pairs_digest(self.train_dataset))
        self.run_guard.check_schedule(fingerprint)  # resume_data_mismatch; recorded in every checkpoint
        self._train_sampler = sampler
        dataset = self.reference_manager.attach(self.train_dataset)
        if isinstance(sampler, PairStepSampler):
            return self._loader(
                StepPairs(dataset), sampler, PairDataLoader, StepCollator(cast(PackedPairCollator, self.data_collator))
            )
        return self._loader(dataset, sampler, PairDataLoader)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        """Every eval pair once; equal micro-batch counts on all ranks (weight-0 fillers: ``samplers.evaluation``)."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, str):
            dataset = cast(dict, self.eval_dataset)[dataset]
        sampler = eval_sampler(self._costs(dataset), self.options.schedule)
        assert_ranks_agree("eval schedule", f"{len(sampler)}")
        return self._loader(WeightedPairs(self.reference_manager.attach(dataset)), sampler, StopSafeDataLoader)

    def _loader(self, dataset: Any, batch_sampler: Any, cls: type[DataLoader], collate_fn: Any = None) -> DataLoader:
        workers = self.args.dataloader_num_workers
        return cls(
            dataset,
            batch_sampler=batch_sampler,
            collate_fn=collate_fn or self.data_collator,
            num_workers=workers,
            pin_memory=self.args.dataloader_pin_memory and torch.cuda.is_available(),
            persistent_workers=self.args.dataloader_persistent_workers and workers > 0,
            prefetch_factor=self.args.dataloader_prefetch_factor if workers > 0 else None,
            worker_init_fn=self.worker_init_fn,  # after the stop-signal filter (fault_tolerance.workers)
        )

    def _costs(self, dataset: Any) -> Any:
        from pair_dpo_trainer.data.costs import pair_cost_array

        # [N] int64 from the Arrow lengths (no Python int per pair), in the run's packed layout
        return pair_cost_array(dataset, share_prompt=self.share_prompt)

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's epoch, not run at all once ``max_steps`` are done: a run resumed from the checkpoint of its
        last step (a final evaluation or save that was interrupted) trains no extra step, so its final model is the
        uninterrupted run's."""
        if 0 < self.state.max_steps <= self.state.global_step:
            self.control.should_training_stop = True
            return None
        return super()._run_epoch(*args, **kwargs)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The GA micro-batches of one step and ``N``, the global pair count of the step (from the schedule)."""
        batch_samples = []
        for _ in range(num_batches):
            try:
                batch_samples.append(next(epoch_iterator))
            except StopIteration:
                break
        if not self._layout_announced and self.is_world_process_zero():
            self._layout_announced = True
            stored = sum(batch.num_row_tokens for batch in batch_samples)  # host ints: no sync; whole rows
            unshared = sum(batch.num_row_unshared_tokens for batch in batch_samples)
            print(first_step_layout(stored, unshared, share_prompt=self.share_prompt), flush=True)
        batch_samples = self.objective_runtime.attach_step_contexts(  # sft / bco_pair / aot need the step (collective)
            batch_samples, margins_fn=self._pair_logps_without_grad, pairs_per_rank=self.args.pairs_per_rank_per_step
        )
        assert self._train_sampler is not None, "get_train_dataloader ran before the first step"
        return batch_samples, self._train_sampler.global_pairs_per_step

    def training_step(self, model, inputs, num_items_in_batch=None):
        """HF's micro-batch ``training_step``; a whole token-budget step (``StepBatch``) runs each of its micro-batches
        through it, gradients synchronised after the last (``accumulation.run_step``)."""
        if isinstance(inputs, StepBatch):
            return run_step(
                inputs,
                accelerator=self.accelerator,
                model=model,
                microbatch_step=lambda batch: self.training_step(model, batch, num_items_in_batch),
            )
        return super().training_step(model, inputs, num_items_in_batch)

    def _get_grad_norm(self, model, grad_norm=None):
        """HF's gradient norm of the step (global over the ranks); a non-finite one skips the optimizer step
        (``training.nonfinite``: one host read per optimizer step)."""
        grad_norm = super()._get_grad_norm(model, grad_norm)
        deepspeed = self.is_deepspeed_enabled
        engine_step = deepspeed_engine_step(self.accelerator, self.lr_scheduler) if deepspeed else None
        step = self.state.global_step + 1
        self.step_guard.after_grad_norm(grad_norm, self.optimizer, step=step, engine_step=engine_step)
        return grad_norm

    def _prepare_inputs(self, inputs: PackedPairBatch) -> PackedPairBatch:  # type: ignore[override]  # not a dict
        """The batch on the device, with LD-DPO token weights when ``ld_alpha`` is set (device ops, no sync)."""
        return with_length_desensitization(inputs.to(self.args.device, non_blocking=True), self.args.ld_alpha)

    def _pair_logps_without_grad(self, batch: PackedPairBatch) -> PairLogps:
        """The per-pair log-probs of a host micro-batch without gradient (AOT's pre-pass over the step)."""
        inputs = self._prepare_inputs(batch)
        with torch.no_grad():
            policy = packed_policy_logps(
                self.model_wrapped, inputs, chunk_size=self.args.logps_chunk_size, with_stats=False
            )
            return pair_logps_from_sequences(policy, self.reference.sequence_logps(inputs), inputs)

    def floating_point_ops(self, inputs: PackedPairBatch | StepBatch) -> int:  # type: ignore[override]  # not a dict
        """6 N T for the policy's forward and backward plus 2 N T for the reference forward (host-known T).

        N (non-embedding parameters, ZeRO-3 partitions counted whole) is counted once and cached: this runs per
        micro-batch.
        """
        if self._flop_params is None:
            self._flop_params = non_embedding_parameters(self.model)
        online_reference = self.reference_manager.runs_reference_forward
        factor = flops_per_token_per_parameter(
            reference_forward=online_reference, prepass=self.objective_runtime.sorts_step
        )
        return factor * self._flop_params * inputs.num_real_tokens  # pad segments do no useful work

    # ------------------------------------------------------------------ loss
    def compute_loss(  # type: ignore[override]  # a PackedPairBatch, not HF's dict of tensors
        self, model, inputs: PackedPairBatch, return_outputs: bool = False, num_items_in_batch=None
    ):
        """Per-pair DPO losses of one micro-batch, scaled as the module docstring explains."""
        with record_function("pair_dpo::policy_logps"):  # profiler ranges: per-region host time in bench_dpo
            policy = packed_policy_logps(model, inputs, chunk_size=self.args.logps_chunk_size)
        with record_function("pair_dpo::reference_logps"):
            ref_logps = self.reference.sequence_logps(inputs)
        with record_function("pair_dpo::loss"):
            pair = pair_logps_from_sequences(policy, ref_logps, inputs)
            output = self.objective_runtime(pair, inputs, training=model.training)
            losses = output.losses
            assert_finite_losses(losses)
            mode = "train" if model.training else "eval"
            self._metrics[mode].update(
                pair,
                losses,
                self.args.beta,
                weights=inputs.pair_weights,
                num_tokens=inputs.num_unshared_tokens,  # TRL's count: each prompt twice, no pad segment
                packed_tokens=inputs.num_real_tokens,  # what ran: a shared prompt once
                components=output.components,
                token_stats=policy.token_stats,
                counts_pairs=inputs.counts_pairs,  # a sequence-parallel group's pairs count once
            )
            data_parallel = self.options.schedule.world_size  # a sequence-parallel group's ranks share its loss
            loss = step_normalized_loss(losses, world_size=data_parallel, global_pairs=num_items_in_batch)
        return (loss, {"losses": losses}) if return_outputs else loss

    # ------------------------------------------------------------------ eval and logging
    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix: str = "eval"
    ) -> EvalLoopOutput:
        """Runs the packed eval forwards and returns pair-weighted metrics reduced over ranks."""
        model = self._wrap_model(self.model, training=False, dataloader=dataloader)
        check_evaluable(self.fsdp_plugin, model)
        if len(self.accelerator._models) == 0 and model is self.model and self.is_deepspeed_enabled:
            model = self.accelerator.prepare_model(model, evaluation_mode=True)
        model.eval()
        metrics = self._metrics["eval"]
        metrics.reset()
        self.callback_handler.eval_dataloader = dataloader  # the Trainer's progress bar (rank 0, unless disable_tqdm)
        with torch.no_grad():
            for inputs in dataloader:
                self.compute_loss(model, self._prepare_inputs(inputs))
                self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)
        reduced = metrics.reduce(self.args.device, prefix=f"{metric_key_prefix}_")
        num_samples = len(dataloader.dataset)
        # no predictions (prediction_loss_only in effect), as the Trainer's own loop returns for that case
        return EvalLoopOutput(predictions=None, label_ids=None, metrics=reduced, num_samples=num_samples)  # type: ignore[arg-type]

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Adds the pair metrics accumulated since the last training log (reduced over ranks here, only here)."""
        if "loss" in logs and not any(key.startswith("eval_") for key in logs):
            train_metrics = self._metrics["train"].reduce(self.args.device, totals=self.state)
            train_metrics.pop("loss", None)  # the Trainer's own loss is the same global pair mean
            logs.update(train_metrics)
            if self.step_guard.skips:  # from the first skip on; a run without one logs TRL's metric names only
                logs[SKIPS_METRIC] = self.step_guard.skips
        super().log(logs, start_time)
