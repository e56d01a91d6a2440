"""The one-line run summary printed on stdout when training starts (rank 0): what runs, in plain words; and on a
job of several nodes one line per node (its local main): what that node did once for its ranks."""

from __future__ import annotations

import os
import socket
from typing import Any

from pair_dpo_trainer.config import PairDPOConfig
from pair_dpo_trainer.data.cache import written_by
from pair_dpo_trainer.losses.registry import uses_reference


def reference_mode(args: PairDPOConfig, source: Any) -> str:
    """``reference-free``, ``precomputed`` or ``online``, with the verified revision (or ``unpinned``), and
    ``replicated (ref_zero_stage=0)`` when asked for."""
    if not uses_reference(args.loss_type, reference_free=args.reference_free):
        return "reference-free"
    mode = "precomputed" if args.precompute_ref_log_probs else "online"
    revision = getattr(source, "revision", None)
    replicated = ", replicated (ref_zero_stage=0)" if getattr(args, "ref_zero_stage", None) == 0 else ""
    return f"{mode}, {'verified revision ' + revision if revision else 'unpinned'}{replicated}"


def _microbatches(args: PairDPOConfig) -> str:
    """How a rank's pairs of a step are split: a fixed count, or the token budget (``pad_to_budget`` noted)."""
    budget = getattr(args, "max_tokens_per_microbatch", None)
    if budget is None:
        return f"{args.gradient_accumulation_steps} micro-batches"
    padded = ", padded to it" if getattr(args, "pad_to_budget", False) else ""
    return f"micro-batches of <= {budget} tokens{padded}"


def run_summary(
    args: PairDPOConfig,
    *,
    attn_backend: str,
    source: Any,
    zero3_leaf_classes: tuple[str, ...] = (),
    fsdp2: bool = False,
) -> str:
    """One line: world size, pairs per step, micro-batches, attention backend, reference mode, verified revision, the
    ZeRO-3 leaf module classes when there are any, and FSDP2 with the reference's layout when it runs.

    Example:
        ``pair_dpo: world_size=2 | 32 pairs/step (16 per rank in 2 micro-batches) | attention torch_varlen |
        reference online, verified revision fc70...``
    """
    per_rank = args.per_device_train_batch_size * args.gradient_accumulation_steps
    leaves = f" | ZeRO-3 leaf modules {','.join(zero3_leaf_classes)}" if zero3_leaf_classes else ""
    if fsdp2:
        layout = "replicated (ref_fsdp_shard=False)" if getattr(args, "ref_fsdp_shard", None) is False else "sharded"
        no_model = (
            not uses_reference(args.loss_type, reference_free=args.reference_free) or args.precompute_ref_log_probs
        )
        leaves += " | FSDP2" + ("" if no_model else f", reference {layout}")
    return (
        f"pair_dpo: world_size={args.world_size} | {per_rank * args.world_size} pairs/step ({per_rank} per rank in "
        f"{_microbatches(args)}) | attention {attn_backend} | "
        f"reference {reference_mode(args, source)} | loss {objective_summary(args)}, beta={args.beta}{leaves}"
    )


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


def announce_run(args: PairDPOConfig, **details: Any) -> None:
    """Prints :func:`run_summary` on stdout (the line a user reads in the launcher's log); rank 0 calls it."""
    print(run_summary(args, **details), flush=True)


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
