"""The run summary printed on stdout when training starts (rank 0): what runs, in plain words.

One line (``pair_dpo: world_size=...``) names the layout, the attention kernel, the reference, the objective with its
options, the precision and how each dataset was rendered; each place where the run deliberately differs from what
TRL 1.16 would do with the same options, or where an option is ignored, follows as one ``pair_dpo: note: ...``
line. On a job of several nodes each node's local main prints one line more (``pair_dpo: node ...``): what that
node did once for its ranks.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pair_dpo_trainer.config import PairDPOConfig
from pair_dpo_trainer.config.sections import ScheduleOptions
from pair_dpo_trainer.data.cache import written_by
from pair_dpo_trainer.losses.registry import uses_reference

STEP_POOLED = ("sft", "aot", "aot_unpaired")
"""Objectives pooled over the optimizer step here and over each micro-batch in TRL 1.16."""


@dataclass(frozen=True)
class RunFacts:
    """What the summary reports besides the config, as the trainer found it at train start.

    Attributes:
        attn_backend: The resolved attention kernel.
        source: The reference source (``revision`` read when present), or None.
        zero3_leaf_classes: ZeRO-3 leaf module classes (empty without ZeRO-3).
        fsdp2: FSDP2 runs.
        precision: The compute precision in words (:func:`precision_summary`); empty: not reported.
        renderings: Dataset name -> how its rows became tokens (``data.dataset.rendering_summary``).
        peft_reference: The reference is the PEFT policy with its adapters disabled.
        ignored_reference: Reference settings a reference-free run does not use.
        layers: What the decoder layers run (``training.layers.LayerPlan``: float8, checkpointing), or None.
        share_prompt: The packed layout: each prompt once (True) or twice (False); None: not reported.
        unshared_reason: Why the prompt is packed twice (``share_prompt`` off or unsupported), else None.
    """

    attn_backend: str
    source: Any = None
    zero3_leaf_classes: tuple[str, ...] = ()
    fsdp2: bool = False
    precision: str = ""
    renderings: Mapping[str, str] = field(default_factory=dict)
    peft_reference: bool = False
    ignored_reference: Sequence[str] = ()
    layers: Any = None
    share_prompt: bool | None = None
    unshared_reason: str | None = None


def layout_summary(facts: RunFacts) -> str:
    """`` | layout shared prompt`` or `` | layout unshared (<why>)``; empty when the layout is not reported."""
    if facts.share_prompt is None:
        return ""
    if facts.share_prompt:
        return " | layout shared prompt"
    return f" | layout unshared ({facts.unshared_reason or 'share_prompt=False'})"


def first_step_layout(num_tokens: int, num_unshared_tokens: int, *, share_prompt: bool) -> str:
    """The line rank 0 prints at its first optimizer step: the tokens it packed and what sharing saved.

    Example:
        >>> first_step_layout(700, 1000, share_prompt=True)[:70]
        'pair_dpo: first step (rank 0): 700 tokens packed, 1000 with each promp'
    """
    if not share_prompt:
        return f"pair_dpo: first step (rank 0): {num_tokens} tokens packed with each prompt twice (unshared layout)"
    saved = 100.0 * (1 - num_tokens / max(num_unshared_tokens, 1))
    return (
        f"pair_dpo: first step (rank 0): {num_tokens} tokens packed, {num_unshared_tokens} with each prompt twice "
        f"(as TRL): {saved:.1f}% saved by the shared-prompt layout"
    )


def reference_mode(args: PairDPOConfig, source: Any, *, peft_reference: bool = False) -> str:
    """``reference-free``, ``precomputed`` or ``online`` (``PEFT adapters disabled`` for a PEFT policy's own base
    model), with the verified revision (or ``unpinned``), and ``replicated (ref_zero_stage=0)`` when asked for."""
    if not uses_reference(args.loss_type, reference_free=args.reference_free):
        return "reference-free"
    mode = "precomputed" if args.precompute_ref_log_probs else "online"
    if peft_reference:
        mode += ", the policy with its PEFT adapters disabled"
    revision = getattr(source, "revision", None)
    replicated = ", replicated (ref_zero_stage=0)" if getattr(args, "ref_zero_stage", None) == 0 else ""
    return f"{mode}, {'verified revision ' + revision if revision else 'unpinned'}{replicated}"


def precision_summary(mixed_precision: str, *, device_type: str, param_dtype: Any = None) -> str:
    """The compute precision in words: ``fp32``, ``bf16 mixed``, ``fp16 mixed``, with the weights' dtype when it is
    not float32 and ``on CPU`` for a CPU run (a bf16 launcher config applies there too).

    Example:
        >>> precision_summary("bf16", device_type="cpu")
        'bf16 mixed on CPU'
    """
    text = "fp32" if mixed_precision in ("no", "", None) else f"{mixed_precision} mixed"
    dtype = str(param_dtype).replace("torch.", "") if param_dtype is not None else "float32"
    if dtype != "float32":
        text += f", {dtype} weights"
    return text + (" on CPU" if device_type == "cpu" else "")


def _microbatches(args: PairDPOConfig) -> str:
    """How a rank's pairs of a step are split: a fixed count, or the token budget (``pad_to_budget`` noted)."""
    budget = getattr(args, "max_tokens_per_microbatch", None)
    if budget is None:
        count = args.gradient_accumulation_steps
        return f"{count} micro-batch{'es' if count != 1 else ''}"
    padded = ", padded to it" if getattr(args, "pad_to_budget", False) else ""
    size = getattr(args, "sequence_parallel_size", 1)
    if size > 1:
        return f"rows of <= {budget * size} tokens, {budget} per rank{padded}"
    return f"micro-batches of <= {budget} tokens{padded}"


def _world(args: PairDPOConfig, data_parallel: int) -> str:
    """``world_size=W``, and the sequence-parallel groups when there are any."""
    size = getattr(args, "sequence_parallel_size", 1)
    if size <= 1:
        return f"world_size={args.world_size}"
    return f"world_size={args.world_size} = {data_parallel} data-parallel x {size} sequence-parallel"


def run_summary(args: PairDPOConfig, facts: RunFacts | None = None, **details: Any) -> str:
    """One line: world size, pairs per step, micro-batches, attention backend, reference mode, verified revision,
    the objective and its options, the precision, each dataset's rendering, the ZeRO-3 leaf module classes when
    there are any, and FSDP2 with the reference's layout when it runs.

    Example:
        ``pair_dpo: world_size=2 | 32 pairs/step (16 per rank in 2 micro-batches) | layout shared prompt | attention
        torch_varlen |
        reference online, verified revision fc70... | loss sigmoid, beta=0.1, label_smoothing=0.0 | precision bf16
        mixed | train: raw text (plain strings)``; ``details`` are the :class:`RunFacts` fields when ``facts`` is None.
    """
    facts = facts if facts is not None else RunFacts(**details)
    per_rank = args.per_device_train_batch_size * args.gradient_accumulation_steps
    leaves = f" | ZeRO-3 leaf modules {','.join(facts.zero3_leaf_classes)}" if facts.zero3_leaf_classes else ""
    if facts.fsdp2:
        layout = "replicated (ref_fsdp_shard=False)" if getattr(args, "ref_fsdp_shard", None) is False else "sharded"
        no_model = (
            not uses_reference(args.loss_type, reference_free=args.reference_free) or args.precompute_ref_log_probs
        )
        leaves += " | FSDP2" + ("" if no_model else f", reference {layout}")
    precision = f" | precision {facts.precision}" if facts.precision else ""
    data = "".join(f" | {name}: {rendering}" for name, rendering in facts.renderings.items())
    reference = reference_mode(args, facts.source, peft_reference=facts.peft_reference)
    unit = "group" if args.sequence_parallel_size > 1 else "rank"
    data_parallel = ScheduleOptions.from_config(args).world_size  # the groups of a sequence-parallel run
    return (
        f"pair_dpo: {_world(args, data_parallel)} | {per_rank * data_parallel} pairs/step ({per_rank} per {unit} in "
        f"{_microbatches(args)}){layout_summary(facts)} | attention {facts.attn_backend} | "
        f"{_reference_words(reference)} | loss "
        f"{objective_summary(args)}, beta={args.beta}, label_smoothing={args.label_smoothing}{precision}{data}{leaves}"
        f"{facts.layers.describe() if facts.layers is not None else ''}{_allocator(args)}"
    )


def _reference_words(mode: str) -> str:
    """``reference online, ...`` / ``reference precomputed, ...``; a run without one says ``reference-free`` alone."""
    return mode if mode == "reference-free" else f"reference {mode}"


def _allocator(args: PairDPOConfig) -> str:
    """`` | CUDA allocator ...`` when the run uses CUDA (what ``PairDPOConfig`` applied, and who chose it)."""
    note = getattr(args, "allocator", "")
    return f" | CUDA allocator {note}" if note and "not used" not in note else ""


def objective_summary(args: PairDPOConfig) -> str:
    """``sigmoid``, or a mixture as ``0.8*sigmoid + 0.2*bco_pair + 1*sft``, plus the per-token options in use."""
    names = list(args.loss_type)
    weights = args.loss_weights
    if len(names) == 1 and weights is None:
        text = names[0]
    else:
        factors = weights if weights is not None else [1.0] * len(names)
        text = " + ".join(f"{w:g}*{name}" for w, name in zip(factors, names, strict=True))
    options = [
        ("use_weighting", args.use_weighting),
        ("ld_alpha", args.ld_alpha),
        ("sync_ref_model", args.sync_ref_model),
    ]
    extra = [f"{key}={value}" for key, value in options if value not in (None, False)]
    if args.f_divergence_type != "reverse_kl":
        extra.append(f"f_divergence_type={args.f_divergence_type}")
    return text + (f" ({', '.join(extra)})" if extra else "")


def run_notes(args: PairDPOConfig, facts: RunFacts) -> list[str]:
    """Plain-words notes: where this run deliberately differs from TRL 1.16 on the same options, and the settings
    it ignores. Empty when there is nothing to say."""
    notes: list[str] = []
    if "sigmoid" in args.loss_type and args.label_smoothing > 0:
        notes.append(
            f"label_smoothing={args.label_smoothing} makes 'sigmoid' conservative DPO (cDPO: the label is assumed "
            "flipped with that probability); TRL 1.16's 'sigmoid' ignores label_smoothing."
        )
    several = args.world_size > 1 or args.gradient_accumulation_steps > 1 or args.max_tokens_per_microbatch
    pooled = [name for name in args.loss_type if name in STEP_POOLED]
    if several and pooled:
        notes.append(
            f"{pooled} pool over the optimizer step's pairs (all micro-batches and ranks: 'sft' averages over the "
            "step's chosen tokens, 'aot' sorts the step's margins); TRL 1.16 pools each micro-batch on its own."
        )
    if not args.reference_free and not uses_reference(args.loss_type):
        notes.append(
            f"loss_type={list(args.loss_type)} needs no reference, so none is built: rewards/* are beta * log pi "
            "(TRL 1.16's DPOTrainer builds a reference for 'sft' too and logs rewards against it)."
        )
    if facts.ignored_reference:
        reason = "reference_free=True" if args.reference_free else f"loss_type={list(args.loss_type)}"
        notes.append(
            f"{reason} builds no reference, so {', '.join(facts.ignored_reference)} "
            f"{'is' if len(facts.ignored_reference) == 1 else 'are'} ignored."
        )
    return notes


def announce_run(args: PairDPOConfig, facts: RunFacts | None = None, **details: Any) -> None:
    """Prints :func:`run_summary` and then each of :func:`run_notes` on stdout (the lines a user reads in the
    launcher's log); rank 0 calls it."""
    facts = facts if facts is not None else RunFacts(**details)
    lines = [run_summary(args, facts), *(f"pair_dpo: note: {note}" for note in run_notes(args, facts))]
    print("\n".join(lines), flush=True)


def node_summary(ranks: list[int], *, train_dataset: Any, source: Any) -> str:
    """One line for this node: its host and ranks, where its train pairs come from (tokenised here, or the node's
    cache entry and who wrote it) and how many reference snapshot files this process hashed.

    Example:
        ``pair_dpo: node node1 (ranks 2-3) | train pairs tokenised here: /scratch/hf/.../pairs.arrow |
        reference snapshot: 6 files hashed here``
    """
    span = f"ranks {ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f"rank {ranks[0]}"
    found = written_by(train_dataset)
    if found is None:
        pairs = "train pairs in memory"
    else:
        arrow, creator = found
        mine = creator.get("host") == socket.gethostname() and creator.get("pid") == os.getpid()
        by = f" (written by pid {creator.get('pid')} on {creator.get('host')})"
        pairs = f"train pairs tokenised here: {arrow}" if mine else f"train pairs from the node's cache: {arrow}{by}"
    hashed = getattr(source, "files_hashed", None)
    reference = "" if hashed is None else f" | reference snapshot: {hashed} files hashed here"
    return f"pair_dpo: node {socket.gethostname()} ({span}) | {pairs}{reference}"


def announce_node(ranks: list[int], **details: Any) -> None:
    """Prints :func:`node_summary` on stdout; each node's local main calls it on a job of several nodes."""
    print(node_summary(ranks, **details), flush=True)
