"""``PairDPOConfig``: every option of pair DPO as a plain ``TrainingArguments`` field.

Batch semantics (in pairs): one optimizer step takes ``per_device_train_batch_size * gradient_accumulation_steps``
pairs on every data-parallel rank, split into ``gradient_accumulation_steps`` packed micro-batches, or, with
``max_tokens_per_microbatch`` (and ``gradient_accumulation_steps=1``), packed into as many micro-batches of at most that
many tokens as the busiest rank of the step needs, the same count on every rank.

``__post_init__`` checks each option's own range and the combinations of options among themselves, collects every
problem and raises one :class:`~pair_dpo_trainer.errors.ConfigError`. What needs a feature's knowledge (objective
names, attention kernels, compile modes, ZeRO-3 module names, reference modes) is checked by that feature and
collected once at trainer start (:func:`pair_dpo_trainer.training.checks.check_config`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from pair_dpo_trainer.config.allocator import apply_allocator_default
from pair_dpo_trainer.config.launch import (
    elastic_restart_problem,
    launch_problem,
    no_gpu_problem,
    precision_problem,
    resolve_bf16,
    resolve_use_cpu,
)
from pair_dpo_trainer.config.option_checks import normalize_loss_fields, option_problems
from pair_dpo_trainer.config.trl_names import config_field_names, reject_unsupported_options
from pair_dpo_trainer.errors import ConfigError, Problem, raise_problems

DEFAULT_MAX_PROMPT_LENGTH = 512
ATTN_AUTO = "auto"


def default_max_prompt_length(max_length: int) -> int:
    """``max_prompt_length`` when unset: 512 (prepare-data's default) if that leaves room for a completion, else half
    of ``max_length`` (a TRL user sets only ``max_length``, e.g. 128)."""
    return DEFAULT_MAX_PROMPT_LENGTH if max_length > DEFAULT_MAX_PROMPT_LENGTH else max_length // 2


@dataclass
class PairDPOConfig(TrainingArguments):
    """Training arguments for :class:`~pair_dpo_trainer.PairDPOTrainer` (a ``TrainingArguments`` subclass).

    Example:
        >>> config = PairDPOConfig(output_dir="out", beta=0.1, loss_type="sigmoid,sft")
        >>> config.loss_type, config.pairs_per_rank_per_step
        (['sigmoid', 'sft'], 8)
    """

    beta: float = field(
        default=0.1, metadata={"help": "DPO temperature beta (> 0): strength of the pull towards the reference."}
    )
    loss_type: list[str] | str = field(
        default_factory=lambda: ["sigmoid"],
        metadata={
            "help": "Preference objective(s) (docs/losses.md lists every name); several (a list, several flag values, "
            "or a comma-separated string) are summed with loss_weights, e.g. MPO: sigmoid bco_pair sft."
        },
    )
    loss_weights: list[float] | None = field(
        default=None,
        metadata={"help": "One weight >= 0 per loss_type entry (e.g. 0.8 0.2 1.0 for MPO). None: all 1.0."},
    )
    label_smoothing: float = field(
        default=0.0,
        metadata={
            "help": "In [0, 0.5): the assumed label-noise rate of 'sigmoid' (cDPO), 'robust' (rDPO), 'aot', "
            "'aot_unpaired' and 'simpo'; EXO's epsilon for 'exo_pair' (required > 0, the paper uses 1e-3)."
        },
    )
    nll_weight: float = field(
        default=1.0, metadata={"help": "Weight of the chosen-completion NLL term of loss_type 'sigmoid_nll' (RPO)."}
    )
    use_weighting: bool = field(
        default=False,
        metadata={"help": "WPO: weight every pair by the policy's length-normalised (aligned) sequence probabilities."},
    )
    ld_alpha: float | None = field(
        default=None,
        metadata={
            "help": "LD-DPO alpha in [0, 1]: weight of the log-probs of the longer completion's tokens beyond the "
            "length both completions share (policy and reference). None (or 1.0): plain sums."
        },
    )
    f_divergence_type: str = field(
        default="reverse_kl",
        metadata={
            "help": "f-DPO divergence: reverse_kl, forward_kl, js_divergence or alpha_divergence; a non-default "
            "value only for objectives on "
            "the chosen-rejected reward difference (see docs/losses.md)."
        },
    )
    f_alpha_divergence_coef: float = field(
        default=0.5, metadata={"help": "Coefficient of f_divergence_type 'alpha_divergence' (TRL's parameterisation)."}
    )
    discopop_tau: float = field(default=0.05, metadata={"help": "DiscoPOP temperature tau (> 0) of 'discopop'."})
    simpo_gamma: float = field(default=0.5, metadata={"help": "SimPO target reward margin gamma of 'simpo'."})
    sync_ref_model: bool = field(
        default=False,
        metadata={
            "help": "TR-DPO: every ref_model_sync_steps optimizer steps the reference becomes "
            "ref_model_mixup_alpha * policy + (1 - ref_model_mixup_alpha) * reference."
        },
    )
    ref_model_mixup_alpha: float = field(
        default=0.6, metadata={"help": "TR-DPO mixing weight alpha in (0, 1] of the policy (sync_ref_model)."}
    )
    ref_model_sync_steps: int = field(
        default=512, metadata={"help": "TR-DPO: optimizer steps between reference updates (>= 1, sync_ref_model)."}
    )
    reference_free: bool = field(
        default=False,
        metadata={"help": "Use an implicit uniform reference (reference log-probs = 0): no reference model is built."},
    )
    ref_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Local directory of the reference model. Default: the policy's own directory."},
    )
    ref_model_revision: str | None = field(
        default=None, metadata={"help": "Pinned 40-hex commit of the reference snapshot (default: the policy's)."}
    )
    ref_model_repo_id: str | None = field(
        default=None, metadata={"help": "Hub repository id of the reference, recorded in its identity (optional)."}
    )
    allow_unpinned_reference: bool = field(
        default=False,
        metadata={
            "help": "Accept a reference that is not verified against a pinned ref_model_revision (logs a warning "
            "and records pinned=false)."
        },
    )
    allow_pickle_weights: bool = field(
        default=False, metadata={"help": "Accept pickle (.bin) reference weights when there are no safetensors."}
    )
    verify_threads: int | None = field(
        default=None, metadata={"help": "Threads hashing the reference snapshot (None: one per core)."}
    )
    max_length: int = field(
        default=1024, metadata={"help": "Maximum tokens of one sequence (prompt + one completion)."}
    )
    max_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "Maximum prompt tokens; longer prompts keep their end (left truncation). None: 512 (prepare-data's "
            "default), or max_length // 2 when max_length <= 512, so setting only max_length (TRL has no prompt "
            "limit) stays valid."
        },
    )
    apply_chat_template_to_strings: bool = field(
        default=False,
        metadata={
            "help": "Render rows of plain strings with the tokenizer's chat template (the prompt as one user turn, "
            "each completion as one assistant turn). Default False: plain strings are tokenised as raw text, as TRL "
            "does; conversations always use the chat template."
        },
    )
    max_tokens_per_microbatch: int | None = field(
        default=None,
        metadata={
            "help": "Token budget of one packed micro-batch (its row length: prompt + chosen + rejected summed over "
            "its pairs with share_prompt, 2 x prompt + chosen + rejected without; a pair is admitted and planned by "
            "its cost in the run's layout). Set: per_device_train_batch_size is the pairs per GPU per "
            "optimizer step, gradient_accumulation_steps must be 1, and each step's pairs are packed into as many "
            "micro-batches of <= this many tokens as the busiest rank needs (the same count on every rank); eval "
            "micro-batches keep to it too; a longer pair is rejected ('pair_too_long'). None: exactly "
            "gradient_accumulation_steps micro-batches per step, sized by pair count."
        },
    )
    pad_to_budget: bool = field(
        default=False,
        metadata={
            "help": "With max_tokens_per_microbatch: pad every packed row to exactly that many tokens with a "
            "zero-weight filler segment, so every micro-batch has one shape (for torch_compile and the allocator; "
            "costs the padded tokens' compute)."
        },
    )
    fp8: str | None = field(
        default=None,
        metadata={
            "help": "Float8 training of the decoder layers' Linear layers with torchao (pip install torchao): "
            "'tensorwise' (dynamic per-tensor scales; FSDP2 all-gathers the weights in float8) or 'rowwise' "
            "(per-row scales, more accurate, slower). The LM head and embeddings stay in the compute dtype; the "
            "reference runs the same recipe (so step 0 is exactly ln 2); packed rows are padded to a multiple of 16 "
            "tokens. Pays off on large matmuls (8B-class models); slower on small ones (docs/benchmarks.md). "
            "None: off."
        },
    )
    activation_checkpointing_mode: str = field(
        default="off",
        metadata={
            "help": "Activation checkpointing of the policy's decoder layers (recompute in backward instead of "
            "storing): 'off'; 'full' (every layer); 'layers:K' (every K-th layer, K >= 2); 'selective' (every "
            "layer, but matmul and attention outputs are kept: only the cheap element-wise ops are recomputed); "
            "'auto' (with max_tokens_per_microbatch: the cheapest of these, then 'full' with activation_offload, then "
            "also tiled_mlp, whose measured peak memory at the token budget fits the GPU, chosen once at the start "
            "of train() and named in the run summary). "
            "Not together with gradient_checkpointing (the Trainer's own, which checkpoints every layer)."
        },
    )
    activation_offload: bool = field(
        default=False,
        metadata={
            "help": "Keep the decoder's saved activations in pinned host memory during forward and copy them back "
            "in backward (torch.autograd.graph.save_on_cpu): less GPU memory, paid for in PCIe copies; best with "
            "activation_checkpointing_mode (only the layer inputs are saved)."
        },
    )
    tiled_mlp: int | str | None = field(
        default=None,
        metadata={
            "help": "Compute every decoder layer's MLP in sequence tiles of this many tokens (forward and backward), "
            "so its intermediate (intermediate_size x tokens) exists for one tile at a time: long rows fit in less "
            "memory, paid for by one more MLP forward per micro-batch. 'auto': tiles of about hidden_size tokens. "
            "None: off (activation_checkpointing_mode='auto' still adds tiles itself when full checkpointing with "
            "offload does not fit; a value set here stays on in every candidate). Not with ZeRO-3 / FSDP2."
        },
    )
    attn_backend: str = field(
        default="auto",
        metadata={
            "help": "Attention for packed rows: auto, flash_attn, torch_varlen or sdpa_segments; 'auto' picks "
            "flash_attn, then torch_varlen (CUDA), then sdpa_segments."
        },
    )
    share_prompt: bool | None = field(
        default=None,
        metadata={
            "help": "Pack each pair's prompt once ([prompt | chosen | rejected], the rejected tokens attending to the "
            "prompt and to themselves only), so the policy's and the reference's passes compute it once: a pair "
            "costs prompt + chosen + rejected tokens instead of 2 x prompt + chosen + rejected. None: on where the "
            "model supports it (no sliding-window attention layers), else off, the run summary says why. True: "
            "required (refused with 'share_prompt_unsupported' where unsupported). False: off."
        },
    )
    sequence_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Ranks that hold one packed row together (Ulysses sequence parallelism: each rank computes a "
            "slice of the row's tokens; attention gathers the whole row for a share of the heads with an "
            "all-to-all), so a pair may be up to sequence_parallel_size x max_tokens_per_microbatch tokens. "
            "Groups are consecutive ranks; the data-parallel size is world_size / sequence_parallel_size. "
            "1: off. DDP and DeepSpeed ZeRO; not FSDP2 ('sequence_parallel_unsupported')."
        },
    )
    logps_chunk_size: int = field(
        default=4096, metadata={"help": "Tokens per chunk of the vocabulary projection in the log-prob computation."}
    )
    precompute_ref_log_probs: bool = field(
        default=False,
        metadata={
            "help": "Compute the reference log-probs of every train/eval pair in one pass before training, cache them "
            "(ref_logps_cache_dir) and free the reference, so training holds one model. A later run or a resume "
            "with the same dataset, reference and truncation reuses the cache without building the reference."
        },
    )
    ref_logps_cache_dir: str | None = field(
        default=None,
        metadata={
            "help": "Directory of the precomputed reference log-prob cache (default: <output_dir>/ref_logps_cache)."
        },
    )
    ref_offload_params: bool | None = field(
        default=None,
        metadata={
            "help": "DeepSpeed ZeRO-3 or FSDP2 only: keep the sharded reference's parameters in CPU memory (True) or "
            "on the accelerator (False). None: the same setting as the policy (offload_param / fsdp_offload_params)."
        },
    )
    ref_zero_stage: int | None = field(
        default=None,
        metadata={
            "help": "DeepSpeed only: ZeRO stage of the reference engine. None: 3 under a ZeRO-3 policy (sharded like "
            "the policy), else 0 (replicated). 0: replicate the reference on every rank even under a ZeRO-3 policy "
            "(no per-layer parameter gathers in its forward; needs the reference's weights in the compute dtype on "
            "every GPU). 3: shard it (only with a ZeRO-3 policy)."
        },
    )
    zero3_leaf_modules: str = field(
        default="auto",
        metadata={
            "help": "DeepSpeed ZeRO-3 only: modules whose parameters are gathered as one unit (DeepSpeed leaf modules: "
            "no hooks inside them). 'auto': every repeated decoder layer of the policy and of a ZeRO-3 reference "
            "(a few hooks per layer instead of one per Linear/norm: far less host time per step; a whole layer "
            "is gathered at a time); none for a PEFT policy. 'none': DeepSpeed's per-submodule hooks. Or "
            "comma-separated class names (not with PEFT)."
        },
    )
    dataset_num_proc: int | None = field(
        default=None,
        metadata={
            "help": "Worker processes that tokenise (or truncate) the datasets, on each node's local main process "
            "while the node's other ranks wait and then memory-map the result (TRL's name). None: the usable cores "
            "(os.sched_getaffinity), at most 32. The tokenised pairs are identical for any value."
        },
    )
    dataset_cache_dir: str | None = field(
        default=None,
        metadata={
            "help": "Directory of the tokenised-pairs cache (Arrow files keyed by the rows, the tokenizer and the "
            "limits, reused by later runs; safe to delete when no run uses it). None: "
            "$HF_DATASETS_CACHE/pair_dpo_trainer/pairs."
        },
    )
    ref_fsdp_shard: bool | None = field(
        default=None,
        metadata={
            "help": "FSDP2 only: shard the frozen reference with fully_shard per decoder layer (True; inference-only: "
            "no gradients, no optimizer state) or replicate it on every rank in the compute dtype (False: no "
            "all-gathers in its forward, a whole copy per GPU). None: shard it like the policy."
        },
    )
    max_nonfinite_grad_skips: int = field(
        default=10,
        metadata={
            "help": "Optimizer steps whose gradient norm is NaN/inf are not applied (the weights and optimizer state "
            "stay as they are; the step still counts, so the learning-rate schedule and the data of every step stay "
            "the same) and are counted in the logs as nonfinite_grad_skips; past this many in one train() call the "
            "run stops with 'nonfinite_gradients'. 0: stop at the first. fp16 runs leave overflowing steps to the "
            "loss scaler."
        },
    )
    allow_resume_data_mismatch: bool = field(
        default=False,
        metadata={
            "help": "Resume even when the checkpoint was trained on another schedule (dataset pair lengths, seed, "
            "batch layout), other data settings (max_length, max_prompt_length, tokenizer) or another objective "
            "(loss_type, beta, ...): the resumed step then indexes this run's schedule and every difference is "
            "logged. Default: refuse with 'resume_data_mismatch' / 'resume_objective_mismatch'."
        },
    )
    # TrainingArguments defaults that pair DPO changes (each for a stated reason):
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Keep the pair columns: the pair collator needs them (default False)."}
    )
    logging_nan_inf_filter: bool = field(
        default=False,
        metadata={
            "help": "HF's filter reads the loss on the host every micro-batch (a GPU sync); pair DPO checks "
            "finiteness on the device instead, so it is off by default."
        },
    )
    ddp_find_unused_parameters: bool | None = field(
        default=False, metadata={"help": "Every parameter gets a gradient in DPO; searching for unused ones is waste."}
    )
    # DPO defaults as TRL's DPOConfig sets them (docs/guide.md, "Defaults that differ from TrainingArguments"):
    learning_rate: float = field(
        default=1e-6,
        metadata={
            "help": "Initial AdamW learning rate (1e-6; TrainingArguments' 5e-5 wrecks a pretrained model in DPO)."
        },
    )
    logging_steps: float = field(
        default=10,
        metadata={"help": "Log every N optimizer steps (or a ratio of the total steps if < 1); default 10."},
    )
    bf16: bool | None = field(  # type: ignore[assignment]  # None: config.launch.resolve_bf16 decides in __post_init__
        default=None,
        metadata={
            "help": "bf16 mixed precision. Unset: on when the accelerate config asks for mixed_precision bf16 (also on "
            "CPU), or when an accelerator with bf16 support is used and neither fp16, use_cpu nor an accelerate "
            "config's fp16/fp8 is set; otherwise off. Contradicting the accelerate config: precision_mismatch; "
            "asked for on a machine without GPUs (no --use_cpu): no_gpu."
        },
    )

    def __new__(cls, *args, **kwargs):
        """Rejects TRL's (and our old) option names with their equivalents before the dataclass ``__init__`` would
        raise ``TypeError: unexpected keyword argument`` (see :mod:`pair_dpo_trainer.config.trl_names`), and records
        which options were given (:attr:`options_given`)."""
        reject_unsupported_options(kwargs, where=cls.__name__, known=config_field_names(cls))
        config = super().__new__(cls)
        config.mark_options_given(kwargs)
        return config

    def mark_options_given(self, names: Sequence[str] | Any) -> None:
        """Records the option names the user set (the constructor's keywords; ``train.py``: the flags or file keys
        given), as opposed to defaults: a prepared dataset's limits replace default limits only."""
        object.__setattr__(self, "_options_given", frozenset(str(name).replace("-", "_") for name in names))

    @property
    def options_given(self) -> frozenset[str]:
        """The option names the user set (:meth:`mark_options_given`)."""
        return getattr(self, "_options_given", frozenset())

    def limits_given(self) -> bool:
        """True when ``max_length`` or ``max_prompt_length`` was set by the user (:attr:`options_given`)."""
        return bool({"max_length", "max_prompt_length"} & self.options_given)

    def __post_init__(self) -> None:
        self.loss_type, self.loss_weights = normalize_loss_fields(self.loss_type, self.loss_weights)
        if self.max_prompt_length is None and isinstance(self.max_length, int):
            self.max_prompt_length = default_max_prompt_length(self.max_length)
        raise_problems(self.option_problems(), what="PairDPOConfig")  # every problem, raised once
        precision = precision_problem(self.bf16, fp16=self.fp16, env=os.environ)
        if precision is not None:
            raise ConfigError("precision_mismatch", precision)
        no_gpu = no_gpu_problem(self.bf16, use_cpu=self.use_cpu, env=os.environ)
        if no_gpu is not None:
            raise ConfigError("no_gpu", no_gpu)
        self.use_cpu = resolve_use_cpu(self.use_cpu, env=os.environ, bf16=self.bf16)
        self.bf16 = resolve_bf16(self.bf16, fp16=self.fp16, use_cpu=self.use_cpu, env=os.environ)
        self.allocator = "use_cpu (the CUDA allocator is not used)" if self.use_cpu else apply_allocator_default()
        super().__post_init__()
        launch = launch_problem(self.world_size, os.environ)
        if launch is not None:
            raise ConfigError("launch_not_one_job", launch)
        restart = elastic_restart_problem(os.environ)
        if restart is not None:
            raise ConfigError("elastic_restart_unsafe", restart)

    def option_problems(self) -> list[Problem]:
        """``(reason_code, message)`` for every option out of its own range or in conflict with another option
        (:func:`pair_dpo_trainer.config.option_checks.option_problems`)."""
        return option_problems(self)

    @property
    def ref_logps_cache_path(self) -> str:
        """The directory of the precomputed reference log-prob cache (``ref_logps_cache_dir`` or its default)."""
        return self.ref_logps_cache_dir or os.path.join(str(self.output_dir), "ref_logps_cache")

    @property
    def pairs_per_rank_per_step(self) -> int:
        """Pairs each data-parallel rank processes per optimizer step."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps
