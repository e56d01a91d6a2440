"""The raw-loop ceilings of ``dpo.py``: the same model and packed rows without the Trainer (``--ceiling``), and
the issue's definition, DOCS x LEN-token documents in one row (``--ceiling-shape``). Neither has an optimizer step."""

from __future__ import annotations

import argparse
import copy
import gc
import time
from typing import Any

import numpy as np
import torch

from benchmarks.rows import VOCAB, Probe, dynamo_graphs, graph_fields, memory_fields, row_head, step_stats
from benchmarks.workload import token_vocab
from pair_dpo_trainer.data.costs import pair_cost_array
from pair_dpo_trainer.modeling.compile import compile_decoder_layers
from pair_dpo_trainer.modeling.logprobs import packed_sequence_logps
from pair_dpo_trainer.samplers import PairStepSampler
from pair_dpo_trainer.trainer import PairDPOTrainer


def _step_batches(trainer: PairDPOTrainer, total_steps: int) -> list[list[Any]]:
    """Per optimizer step, on the device: ALL pairs this rank's schedule gives the step as ONE packed row; with a
    token budget the step's micro-batch rows as the trainer ran them (each ``<= max_tokens_per_microbatch``)."""
    args = trainer.args
    steps = PairStepSampler(
        pair_cost_array(trainer.train_dataset, share_prompt=trainer.share_prompt),  # the trainer's layout
        world_size=args.world_size,
        rank=args.process_index,
        pairs_per_rank=args.pairs_per_rank_per_step,
        microbatches=None if args.max_tokens_per_microbatch else args.gradient_accumulation_steps,
        max_tokens_per_microbatch=args.max_tokens_per_microbatch,
        seed=args.data_seed if args.data_seed is not None else args.seed,
    )
    batches = []
    for step in list(steps)[:total_steps]:
        rows = step if args.max_tokens_per_microbatch else [[i for mb in step for i in mb]]
        batches.append([trainer.data_collator([trainer.train_dataset[i] for i in row]).to(args.device) for row in rows])
    return batches


def _free_training_state(trainer: PairDPOTrainer) -> None:
    """Drops the optimizer state and cached blocks so the ceiling's peak memory is its own."""
    trainer.optimizer = None
    trainer.lr_scheduler = None
    trainer.accelerator.free_memory()
    trainer.model.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def shape_batches(
    trainer: PairDPOTrainer, docs: int, length: int, steps: int, seed: int, vocab: int = VOCAB
) -> list[Any]:
    """Per step: ``docs`` random documents of exactly ``length`` tokens packed into ONE row on the device.

    Built with the trainer's own collator (in the unshared layout: the documents stay apart) as ``docs / 2`` pairs
    of a 1-token prompt and two ``length - 1``-token completions, so ``cu_seqlens`` is ``0, length, 2 length, ...``
    and every token after a document's first is scored (``length - 1`` log-probs per document). Ids are drawn from
    ``[3, vocab)`` like the workload's.

    Example:
        One row of 2 x 16 tokens: ``cu_seqlens == [0, 16, 32]``, 30 scored tokens.
    """
    rng = np.random.default_rng(seed + 7919)
    collator = copy.copy(trainer.data_collator)
    collator.share_prompt = False
    batches = []
    for _ in range(steps):
        pairs = [
            {
                "prompt_input_ids": rng.integers(3, vocab, 1).tolist(),
                "chosen_input_ids": rng.integers(3, vocab, length - 1).tolist(),
                "rejected_input_ids": rng.integers(3, vocab, length - 1).tolist(),
            }
            for _ in range(docs // 2)
        ]
        batches.append([collator(pairs).to(trainer.args.device)])
    return batches


def compile_for_ceiling(args: argparse.Namespace, trainer: PairDPOTrainer) -> int:
    """With ``--compile``: compiles the policy's and the reference's decoder layers in place with the trainer's
    options (``compile_decoder_layers``; idempotent, so layers the trainer compiled in ``train()`` stay as they
    are); returns the number of layers compiled now. The graphs themselves are built in the first warmup step."""
    if not args.compile:
        return 0
    options = {"backend": args.compile_backend, "mode": args.compile_mode}
    compiled = compile_decoder_layers(trainer.model, **options)
    reference_model = getattr(trainer.reference, "model", None) if args.reference == "online" else None
    if isinstance(reference_model, torch.nn.Module):
        compiled += compile_decoder_layers(reference_model, **options)
    return compiled


def raw_loop(
    ctx: dict[str, Any], trainer: PairDPOTrainer, batches: list[list[Any]]
) -> tuple[list[float], dict[str, Any]]:
    """Times each step (a list of packed rows): policy ``packed_sequence_logps`` forward + backward and the reference's
    no-grad forward of every row under bf16 autocast, CUDA sync around each step; no Trainer, NO optimizer step, no
    data loading. The first ``--warmup`` steps (where ``--compile`` builds its graphs) are untimed. Returns the timed
    step times and the compile fields of the row."""
    args, probe = ctx["args"], Probe(ctx["cuda"], None)
    _free_training_state(trainer)
    compiled_now = compile_for_ceiling(args, trainer)
    graphs0 = dynamo_graphs() if args.compile else 0
    model, chunk = trainer.model, trainer.args.logps_chunk_size
    model.train()
    autocast = torch.autocast(trainer.args.device.type, dtype=torch.bfloat16, enabled=trainer.args.bf16)
    dts, graphs = [], []
    for rows in batches:
        probe.sync()
        start = time.perf_counter()
        for batch in rows:
            with autocast:
                policy = packed_sequence_logps(model, batch, chunk_size=chunk)
                online = args.reference == "online"
                ref = trainer.reference.sequence_logps(batch) if online else torch.zeros_like(policy)
                loss = (policy - ref).sum()
            loss.backward()
        model.zero_grad(set_to_none=True)
        probe.sync()
        dts.append(time.perf_counter() - start)
        if args.compile:
            graphs.append(dynamo_graphs())
    extra: dict[str, Any] = {"first_step_s": round(dts[0], 3) if dts else None}
    if args.compile:
        extra.update(graph_fields(graphs0, graphs, args.warmup), layers_compiled_here=compiled_now)
    return dts[args.warmup :], extra


def run_ceiling(ctx: dict[str, Any], trainer: PairDPOTrainer) -> dict[str, Any]:
    """Raw loop (:func:`raw_loop`), same model and same real tokens per step in ONE packed row (all pairs this rank's
    schedule gives each step, concatenated), or with a budget in the step's micro-batch rows; policy forward +
    backward and the reference's no-grad forward."""
    args = ctx["args"]
    batches = _step_batches(trainer, args.warmup + args.steps)
    timed, extra = raw_loop(ctx, trainer, batches)
    rows = batches[args.warmup :]
    real = sum(_real_tokens(b) for step in rows for b in step)
    tok_s = real / sum(timed)
    return {
        **row_head(ctx, trainer, "pair_dpo_ceiling", tok_s),
        "bs_pairs": trainer.args.pairs_per_rank_per_step,
        "ceiling_rows": "microbatches" if trainer.args.max_tokens_per_microbatch else "one row per step",
        **step_stats(timed),
        "real_tokens_per_step": round(real / len(rows), 1),
        "microbatches_per_step_mean": round(sum(len(step) for step in rows) / len(rows), 2),
        **memory_fields(ctx["cuda"]),
        "step_s": [round(d, 3) for d in timed],
        **extra,
    }


def _real_tokens(batch: Any) -> int:
    """Tokens of a row's real sequences (a ``pad_to_budget`` pad segment not counted); host-side tensor."""
    return int(batch.cu_seqlens[batch.num_sequences])


def run_shape_ceiling(ctx: dict[str, Any], trainer: PairDPOTrainer) -> dict[str, Any]:
    """The issue's packed ceiling: :func:`raw_loop` on ``--ceiling-shape DOCSxLEN`` rows (:func:`shape_batches`,
    fresh random documents every step), same model, reference, autocast and compile as the other ceiling; no
    optimizer step (as :func:`run_ceiling`). Real tokens per step = DOCS x LEN (each document once)."""
    args = ctx["args"]
    docs, length = args.ceiling_shape
    batches = shape_batches(trainer, docs, length, args.warmup + args.steps, args.seed, token_vocab(args.model_size))
    timed, extra = raw_loop(ctx, trainer, batches)
    real = docs * length * len(timed)
    tok_s = real / sum(timed)
    return {
        **row_head(ctx, trainer, "pair_dpo_ceiling_shape", tok_s, tag=f"{args.tag}_ceiling{docs}x{length}"),
        "ceiling_shape": f"{docs}x{length}",
        "docs_per_step": docs,
        "doc_len": length,
        "bs_pairs": docs // 2,
        **step_stats(timed),
        "real_tokens_per_step": float(docs * length),
        **memory_fields(ctx["cuda"]),
        "step_s": [round(d, 3) for d in timed],
        **extra,
    }
