"""The run's options in per-feature sections: a feature receives the section it reads, never the whole
``PairDPOConfig``.

Each section is a frozen dataclass built once per run from the config by its ``from_config`` (the trainer builds them
all through ``training.options.run_options`` once the config is settled). A decision that needs a feature's
knowledge is made by the option collection and passed in (``ReferenceOptions.uses_reference``: the objective table
lives in ``losses/``), so no feature recomputes it. Only HF's own ``TrainingArguments`` fields and this package's
fields are read; every value keeps the config's meaning and name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReferenceOptions:
    """What the reference (its source, build, checks and precompute pass) reads of the run's options.

    Attributes:
        uses_reference: The run builds a reference (decided once from ``loss_type`` and ``reference_free``).
        no_reference_reason: Why it builds none, for messages (``"reference_free=True"``, ...); None when it does.
        ref_model_name_or_path / ref_model_revision / ref_model_repo_id / allow_unpinned_reference /
            allow_pickle_weights / verify_threads: where the reference comes from and how it is verified.
        precompute_ref_log_probs / ref_logps_cache_path: the precomputed reference and its cache directory.
        ref_zero_stage / ref_offload_params / ref_fsdp_shard: the layout of a DeepSpeed or FSDP2 reference.
        sync_ref_model / ref_model_mixup_alpha / ref_model_sync_steps: TR-DPO's reference sync.
    """

    uses_reference: bool
    no_reference_reason: str | None = None
    ref_model_name_or_path: str | None = None
    ref_model_revision: str | None = None
    ref_model_repo_id: str | None = None
    allow_unpinned_reference: bool = False
    allow_pickle_weights: bool = False
    verify_threads: int | None = None
    precompute_ref_log_probs: bool = False
    ref_logps_cache_path: str = "ref_logps_cache"
    ref_zero_stage: int | None = None
    ref_offload_params: bool | None = None
    ref_fsdp_shard: bool | None = None
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512

    @classmethod
    def from_config(cls, config: Any, *, uses_reference: bool, no_reference_reason: str | None) -> ReferenceOptions:
        """The section of a ``PairDPOConfig``; ``uses_reference`` and its reason come from the objective table."""
        return cls(
            uses_reference=uses_reference,
            no_reference_reason=None if uses_reference else no_reference_reason,
            ref_model_name_or_path=config.ref_model_name_or_path,
            ref_model_revision=config.ref_model_revision,
            ref_model_repo_id=config.ref_model_repo_id,
            allow_unpinned_reference=bool(config.allow_unpinned_reference),
            allow_pickle_weights=bool(config.allow_pickle_weights),
            verify_threads=config.verify_threads,
            precompute_ref_log_probs=bool(config.precompute_ref_log_probs),
            ref_logps_cache_path=config.ref_logps_cache_path,
            ref_zero_stage=config.ref_zero_stage,
            ref_offload_params=config.ref_offload_params,
            ref_fsdp_shard=config.ref_fsdp_shard,
            sync_ref_model=bool(config.sync_ref_model),
            ref_model_mixup_alpha=float(config.ref_model_mixup_alpha),
            ref_model_sync_steps=int(config.ref_model_sync_steps),
        )

    @property
    def runs_forward(self) -> bool:
        """Whether each training micro-batch runs a reference forward (one exists and is not precomputed)."""
        return self.uses_reference and not self.precompute_ref_log_probs


@dataclass(frozen=True)
class ObjectiveOptions:
    """Which objectives the run mixes and the options their checks read (the hyper-parameters the loss functions
    take are ``losses.LossParams``).

    Attributes:
        loss_type: The objectives' names, in the config's order.
        loss_weights: One weight per objective, or None (1 each).
        use_weighting: WPO's weighting of each pair's loss.
        label_smoothing: The label smoothing (cDPO / rDPO / EXO / AOT / SimPO's epsilon).
        f_divergence_type: f-DPO's divergence.
    """

    loss_type: tuple[str, ...]
    loss_weights: tuple[float, ...] | None = None
    use_weighting: bool = False
    label_smoothing: float = 0.0
    f_divergence_type: str = "reverse_kl"

    @classmethod
    def from_config(cls, config: Any) -> ObjectiveOptions:
        """The section of a ``PairDPOConfig`` (``loss_type`` a list once it is built)."""
        weights = config.loss_weights
        return cls(
            loss_type=tuple(config.loss_type),
            loss_weights=None if weights is None else tuple(weights),
            use_weighting=bool(config.use_weighting),
            label_smoothing=float(config.label_smoothing),
            f_divergence_type=config.f_divergence_type,
        )


@dataclass(frozen=True)
class LayerOptions:
    """What runs inside the decoder layers and the log-prob head (policy and in-process reference alike).

    Attributes:
        attn_backend: The packed attention kernel asked for (``"auto"`` or a backend name).
        fp8: The float8 recipe, or None.
        activation_checkpointing_mode: ``off`` / ``full`` / ``selective`` / ``layers:K`` / ``auto``.
        activation_offload: Saved activations wait in host memory.
        torch_compile / torch_compile_backend / torch_compile_mode: regional compile of the decoder layers.
        logps_chunk_size: Scored tokens per chunk of the log-prob head.
        zero3_leaf_modules: ``zero3_leaf_modules`` as given (``"auto"``, ``"none"`` or class names).
        sequence_parallel_size: Ranks whose models hold one row together (1: none).
        tiled_mlp: The decoder MLPs' sequence tiles (None: whole rows; ``"auto"`` or a tile size in tokens).
    """

    attn_backend: str = "auto"
    fp8: str | None = None
    activation_checkpointing_mode: str = "off"
    activation_offload: bool = False
    torch_compile: bool = False
    torch_compile_backend: str | None = None
    torch_compile_mode: str | None = None
    logps_chunk_size: int = 4096
    zero3_leaf_modules: str = "auto"
    sequence_parallel_size: int = 1
    tiled_mlp: int | str | None = None

    @classmethod
    def from_config(cls, config: Any) -> LayerOptions:
        """The section of a ``PairDPOConfig``."""
        return cls(
            attn_backend=config.attn_backend,
            fp8=config.fp8,
            activation_checkpointing_mode=config.activation_checkpointing_mode,
            activation_offload=bool(config.activation_offload),
            torch_compile=bool(config.torch_compile),
            torch_compile_backend=config.torch_compile_backend,
            torch_compile_mode=config.torch_compile_mode,
            logps_chunk_size=int(config.logps_chunk_size),
            zero3_leaf_modules=config.zero3_leaf_modules,
            sequence_parallel_size=int(getattr(config, "sequence_parallel_size", 1)),
            tiled_mlp=getattr(config, "tiled_mlp", None),
        )

    @property
    def compile_backend(self) -> str:
        """The ``torch.compile`` backend of the layers (``torch_compile_backend``, else inductor)."""
        return self.torch_compile_backend or "inductor"


@dataclass(frozen=True)
class BatchLimits:
    """How long a pair and a micro-batch may be, and how a packed row is laid out.

    Attributes:
        max_length: Tokens of prompt + completion per sequence.
        max_prompt_length: Prompt tokens (an int once the config is built).
        max_tokens_per_microbatch: The token budget of a micro-batch, or None (a fixed pair count).
        pad_to_budget: Pad every packed row to exactly the budget.
        share_prompt: The shared-prompt layout as asked (None: where the model supports it).
        ld_alpha: LD-DPO's weight of the completion tokens past the shorter one's length, or None.
        sequence_parallel_size: Ranks that hold one row together: a row holds ``sequence_parallel_size`` budgets.
    """

    max_length: int
    max_prompt_length: int
    max_tokens_per_microbatch: int | None = None
    pad_to_budget: bool = False
    share_prompt: bool | None = None
    ld_alpha: float | None = None
    sequence_parallel_size: int = 1

    @classmethod
    def from_config(cls, config: Any) -> BatchLimits:
        """The section of a ``PairDPOConfig`` whose limits are settled (a prepared dataset's included)."""
        return cls(
            max_length=int(config.max_length),
            max_prompt_length=int(config.max_prompt_length),
            max_tokens_per_microbatch=config.max_tokens_per_microbatch,
            pad_to_budget=bool(config.pad_to_budget),
            share_prompt=config.share_prompt,
            ld_alpha=getattr(config, "ld_alpha", None),
            sequence_parallel_size=int(getattr(config, "sequence_parallel_size", 1)),
        )

    @property
    def row_token_budget(self) -> int | None:
        """The tokens of one packed row (what a pair is admitted by and a padded row is padded to): the per-rank
        budget times the ranks that hold the row, or None without a budget."""
        return _row_budget(self.max_tokens_per_microbatch, self.sequence_parallel_size)


@dataclass(frozen=True)
class ScheduleOptions:
    """Which pairs this rank processes: the pair-atomic train and eval schedules.

    Attributes:
        world_size: Data-parallel ranks (the processes, or their sequence-parallel groups).
        rank: This process's data-parallel rank (its group's index under sequence parallelism).
        pairs_per_rank: Train pairs per rank per optimizer step (``pairs_per_rank_per_step``).
        microbatches: ``gradient_accumulation_steps`` (the micro-batches of a step without a token budget).
        seed: The schedule's seed (``data_seed``, else ``seed``).
        eval_pairs_per_microbatch: ``per_device_eval_batch_size``.
        max_tokens_per_microbatch: The token budget of a micro-batch's row (a group's row under sequence
            parallelism), or None.
        sequence_shard: ``(rank in its sequence-parallel group, group size)``, or None without groups.
    """

    world_size: int = 1
    rank: int = 0
    pairs_per_rank: int = 1
    microbatches: int = 1
    seed: int = 42
    eval_pairs_per_microbatch: int = 8
    max_tokens_per_microbatch: int | None = None
    sequence_shard: tuple[int, int] | None = None

    @classmethod
    def from_config(cls, config: Any) -> ScheduleOptions:
        """The section of a ``TrainingArguments`` / ``PairDPOConfig`` (its process placement read now)."""
        size = int(getattr(config, "sequence_parallel_size", 1))
        return cls(
            world_size=max(int(config.world_size) // size, 1),
            rank=int(config.process_index) // size,
            pairs_per_rank=int(config.per_device_train_batch_size * config.gradient_accumulation_steps),
            microbatches=int(config.gradient_accumulation_steps),
            seed=int(config.data_seed if config.data_seed is not None else config.seed),
            eval_pairs_per_microbatch=int(config.per_device_eval_batch_size),
            max_tokens_per_microbatch=_row_budget(getattr(config, "max_tokens_per_microbatch", None), size),
            sequence_shard=(int(config.process_index) % size, size) if size > 1 else None,
        )


def _row_budget(budget: int | None, size: int) -> int | None:
    """A packed row's tokens: ``size`` ranks' per-rank budgets (None without a budget)."""
    return None if budget is None else budget * size


@dataclass(frozen=True)
class DataOptions:
    """How dataset arguments become tokenised pairs.

    Attributes:
        num_proc: ``dataset_num_proc`` as given (None: chosen from the CPUs).
        cache_dir: ``dataset_cache_dir`` (the pairs cache), or None.
        apply_chat_template_to_strings: Render plain-string rows with the chat template.
        progress: Show progress bars (``not disable_tqdm``).
        num_workers: ``dataloader_num_workers`` (the reference precompute pass's loader).
    """

    num_proc: int | None = None
    cache_dir: str | None = None
    apply_chat_template_to_strings: bool = False
    progress: bool = True
    num_workers: int = 0

    @classmethod
    def from_config(cls, config: Any) -> DataOptions:
        """The section of a ``PairDPOConfig``."""
        return cls(
            num_proc=config.dataset_num_proc,
            cache_dir=config.dataset_cache_dir,
            apply_chat_template_to_strings=bool(config.apply_chat_template_to_strings),
            progress=not config.disable_tqdm,
            num_workers=int(config.dataloader_num_workers),
        )


@dataclass(frozen=True)
class FsdpOptions:
    """What the FSDP2 set-up and its checks read of HF's ``TrainingArguments``.

    Attributes:
        plugin_args: ``fsdp_plugin_args`` (``fsdp`` / ``fsdp_config`` as the Trainer builds them), or None.
        parallelism_config: A ``parallelism_config`` is set.
        gradient_checkpointing: The Trainer's gradient checkpointing is on.
        torch_compile: The decoder layers are compiled.
        save_only_model / load_best_model_at_end: the Trainer's saving fields.
    """

    plugin_args: Mapping[str, Any] | None = None
    parallelism_config: bool = False
    gradient_checkpointing: bool = False
    torch_compile: bool = False
    save_only_model: bool = False
    load_best_model_at_end: bool = False

    @classmethod
    def from_config(cls, config: Any) -> FsdpOptions:
        """The section of a ``TrainingArguments`` / ``PairDPOConfig``."""
        return cls(
            plugin_args=getattr(config, "fsdp_plugin_args", None),
            parallelism_config=getattr(config, "parallelism_config", None) is not None,
            gradient_checkpointing=bool(getattr(config, "activation_checkpointing", False))
            or bool(config.gradient_checkpointing),
            torch_compile=bool(config.torch_compile),
            save_only_model=bool(config.save_only_model),
            load_best_model_at_end=bool(config.load_best_model_at_end),
        )
