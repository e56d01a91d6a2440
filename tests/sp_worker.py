"""Worker for tests/test_sequence_parallel.py: sequence parallelism in real processes (gloo on CPU).

Usage: ``torchrun --nproc_per_node W tests/sp_worker.py OUT_DIR SIZE PHASES`` (PHASES comma-separated), or W
ranks forked with a launcher's environment (``tests/launch.py: ranks``).

Phases (rank 0 writes each result under OUT_DIR; the test compares them with one process):
  model: float64 per-sequence log-probs and every parameter gradient of a group of SIZE ranks against the same model
      run whole on each rank (no collective), for the shared-prompt and unshared layouts, a model whose key/value
      heads divide among the ranks and one with a single key/value head (copied per rank); prompts' NLL positions
      (ORPO) and LD-DPO token weights on the way.
  compiled: the group's decoder layers compiled (fullgraph, dynamic): eager log-probs and gradients, one graph.
  train: 3 AdamW steps of the trainer under a token budget with a pair longer than one rank's budget (it fits the
      group's row); saves a checkpoint at step 2; parameters, losses and the first step's gradients; then an eval
      over EVAL_PAIRS pairs by the same budget.
  resume: resumes the train phase's checkpoint-2 and trains step 3: parameters to compare with the train phase.
  precompute: the train phase's run with precomputed reference log-probs: its losses.
  too_long: a group whose row is shorter than the long pair: the error when the trainer is built.
  resize: the same checkpoint resumed by the same ranks without groups (another data-parallel size): refused.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.dpo_fixtures import cpu_config, synthetic_pairs  # noqa: E402
from tests.models import tiny_llama, tiny_tokenizer  # noqa: E402

BUDGET = 40
"""Tokens per rank per micro-batch in the train phase: the long pair (50 tokens shared, 80 unshared) needs two
ranks."""
STEPS = 3
EVAL_PAIRS = 13
"""An odd number of eval pairs: a group of 2 data-parallel groups gets a weight-0 filler."""


def long_pairs(n: int) -> list[dict[str, list[int]]]:
    """:func:`synthetic_pairs` with one pair of a 30-token prompt (50 tokens shared, 80 unshared)."""
    pairs = synthetic_pairs(n)
    pairs[3] = {
        "prompt_input_ids": [4 + i % 50 for i in range(30)],
        "chosen_input_ids": [5 + i % 40 for i in range(9)] + [2],
        "rejected_input_ids": [7 + i % 30 for i in range(9)] + [2],
    }
    return pairs


def model_phase(out: Path, size: int, rank: int) -> None:
    from pair_dpo_trainer.collators.packed import PackedPairCollator
    from pair_dpo_trainer.losses.length_weights import length_desensitized_weights
    from pair_dpo_trainer.modeling.attention import enable_pair_varlen
    from pair_dpo_trainer.modeling.logprobs import packed_policy_logps
    from pair_dpo_trainer.parallel.sequence import apply_sequence_parallel

    results = {}
    features = synthetic_pairs(5, seed=3)
    for kv_heads in (2, 1):
        whole = tiny_llama(0).double()
        whole.config.num_key_value_heads = kv_heads
        if kv_heads == 1:  # a model with one key/value head: rebuilt with that shape
            config = copy.deepcopy(whole.config)
            torch.manual_seed(0)
            whole = type(whole)(config).double()
        enable_pair_varlen(whole, "sdpa_segments")
        parallel = copy.deepcopy(whole)
        apply_sequence_parallel(parallel, size)
        for share in (True, False):
            full = PackedPairCollator(share_prompt=share, score_chosen_prompts=True)(features)
            mine = PackedPairCollator(share_prompt=share, score_chosen_prompts=True, sequence_shard=(rank, size))
            sharded = mine(features)
            weights = length_desensitized_weights(full, 0.5)
            key = f"kv{kv_heads}_{'shared' if share else 'unshared'}"
            results[key] = compare(whole, parallel, full, sharded, weights, packed_policy_logps)
    if rank == 0:
        (out / "model.json").write_text(json.dumps(results))


def compiled_phase(out: Path, size: int, rank: int) -> None:
    """The group's decoder layers compiled (``fullgraph``, dynamic shapes, aot_eager; the traceable CPU varlen kernel)
    on 3 batches of different lengths: the log-probs and gradients of the eager whole model, one graph, no break."""
    import pytest
    from torch._dynamo.utils import counters

    from pair_dpo_trainer.collators.packed import PackedPairCollator
    from pair_dpo_trainer.modeling.attention import enable_pair_varlen
    from pair_dpo_trainer.modeling.compile import compile_decoder_layers
    from pair_dpo_trainer.modeling.logprobs import packed_sequence_logps
    from pair_dpo_trainer.parallel.sequence import apply_sequence_parallel
    from pair_dpo_trainer.testing.cpu_varlen import install_traceable_varlen

    with pytest.MonkeyPatch.context() as patch:
        backend = install_traceable_varlen(patch)
        whole = tiny_llama(0)
        enable_pair_varlen(whole, backend, device="cpu")
        parallel = copy.deepcopy(whole)
        apply_sequence_parallel(parallel, size)
        compiled = compile_decoder_layers(parallel, backend="aot_eager", fullgraph=True)
        diffs = []
        for seed in (3, 4, 5):
            features = synthetic_pairs(4, seed=seed)
            results = []
            for model, shard in ((whole, None), (parallel, (rank, size))):
                model.zero_grad()
                batch = PackedPairCollator(share_prompt=True, sequence_shard=shard)(features)
                logps = packed_sequence_logps(model, batch)
                (logps * torch.arange(1.0, logps.numel() + 1)).sum().backward()
                grads = {n: p.grad.clone() for n, p in model.named_parameters()}
                results.append((logps.detach(), grads))
            (want, want_grads), (got, got_grads) = results
            for grad in got_grads.values():
                dist.all_reduce(grad)
                grad /= dist.get_world_size()
            diffs.append(
                max(
                    float((got - want).abs().max()),
                    *(float((got_grads[n] - g).abs().max()) for n, g in want_grads.items()),
                )
            )
    if rank == 0:
        stats = {"compiled": compiled, "diffs": diffs, "graphs": counters["stats"]["unique_graphs"]}
        stats["breaks"] = sum(counters["graph_break"].values())
        (out / "compiled.json").write_text(json.dumps(stats))


def compare(whole, parallel, full, sharded, weights, packed_policy_logps) -> dict:
    """Max relative differences of the per-sequence sums and of every gradient, group vs whole."""
    from dataclasses import replace

    def run(model, batch):
        model.zero_grad()
        logps = packed_policy_logps(model, replace(batch, token_weights=weights), chunk_size=7, with_stats=True)
        loss = (logps.logps * torch.linspace(0.5, 1.5, logps.logps.numel(), dtype=torch.float64)).sum()
        loss = loss + 0.3 * logps.nll_logps.sum() + 0.2 * logps.prompt_logps.sum()
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        return logps, grads

    ref_logps, ref_grads = run(whole, full)
    logps, grads = run(parallel, sharded)
    for grad in grads.values():  # each rank carries the group's loss; DDP's mean over the ranks gives the gradient
        dist.all_reduce(grad)
        grad /= dist.get_world_size()

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    return {
        "logps": rel(logps.logps, ref_logps.logps),
        "nll_logps": rel(logps.nll_logps, ref_logps.nll_logps),
        "prompt_logps": rel(logps.prompt_logps, ref_logps.prompt_logps),
        "prompt_token_counts": rel(logps.prompt_token_counts, ref_logps.prompt_token_counts),
        "token_stats": rel(logps.token_stats, ref_logps.token_stats),
        "grads": max(rel(grads[n], ref_grads[n]) for n in ref_grads),
        "grad_norm": float(sum(g.norm() ** 2 for g in ref_grads.values()) ** 0.5),
    }


def train_options(out: Path, size: int, **overrides) -> dict:
    return {
        "output_dir": str(out),
        "max_steps": STEPS,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "max_tokens_per_microbatch": BUDGET,
        "sequence_parallel_size": size,
        "learning_rate": 1e-2,
        "max_grad_norm": 0.0,
        "save_strategy": "steps",
        "save_steps": 2,
        "attn_backend": "sdpa_segments",
        **overrides,
    }


def record(trainer, recorder) -> dict:
    return {
        "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "grads": recorder.grads,
        "microbatch_counts": trainer._train_sampler.microbatch_counts()[:STEPS],
    }


def one_process(out: Path, *, pairs_per_step: int, eval_pairs=None) -> dict:
    """The train phase's run in this process without groups, ``pairs_per_step`` pairs per step in rows of the
    group's budget (2 x BUDGET tokens); with ``eval_pairs``, then an eval by the same budget."""
    from pair_dpo_trainer import PairDPOTrainer
    from tests.dist_worker import FirstStepGradients

    options = train_options(out / "run", 1, max_tokens_per_microbatch=2 * BUDGET, save_strategy="no")
    options["per_device_train_batch_size"] = pairs_per_step
    trainer = PairDPOTrainer(
        model=tiny_llama(0), args=cpu_config(out, **options), train_dataset=long_pairs(24),
        processing_class=tiny_tokenizer(),
    )  # fmt: skip
    recorder = FirstStepGradients()
    trainer.add_callback(recorder)
    trainer.train()
    result = record(trainer, recorder)
    if eval_pairs is not None:
        result["eval"] = trainer.evaluate(eval_dataset=eval_pairs)
    return result


def train_phase(out: Path, size: int, rank: int, *, resume: bool = False) -> None:
    from pair_dpo_trainer import PairDPOTrainer
    from tests.dist_worker import FirstStepGradients

    run_dir = out / "run"
    config = cpu_config(out, **train_options(run_dir, size))
    trainer = PairDPOTrainer(
        model=tiny_llama(0), args=config, train_dataset=long_pairs(24), processing_class=tiny_tokenizer()
    )
    recorder = FirstStepGradients()
    trainer.add_callback(recorder)
    trainer.train(resume_from_checkpoint=str(run_dir / "checkpoint-2") if resume else None)
    result = record(trainer, recorder)
    if not resume:
        result["eval"] = trainer.evaluate(eval_dataset=synthetic_pairs(EVAL_PAIRS, seed=9))
    if rank == 0:
        torch.save(result, out / ("resume.pt" if resume else "train.pt"))


def precompute_phase(out: Path, size: int, rank: int) -> None:
    """The train phase's run with ``precompute_ref_log_probs`` (the group computes each pair's reference log-probs
    once, its first rank reports them): its losses, to compare with the online reference's."""
    from pair_dpo_trainer import PairDPOTrainer

    options = train_options(out / "pre", size, save_strategy="no", precompute_ref_log_probs=True)
    trainer = PairDPOTrainer(
        model=tiny_llama(0), args=cpu_config(out, **options), train_dataset=long_pairs(24),
        processing_class=tiny_tokenizer(),
    )  # fmt: skip
    trainer.train()
    if rank == 0:
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        (out / "precompute.json").write_text(json.dumps({"losses": losses}))


def resize_phase(out: Path, rank: int) -> None:
    """The train phase's checkpoint-2 resumed by the same 2 ranks without groups (2 data-parallel ranks of 4 pairs:
    another schedule); records the error each rank raises."""
    from pair_dpo_trainer import PairDPOTrainer
    from pair_dpo_trainer.errors import PairDPOError

    run_dir = out / "run"
    config = cpu_config(out, **train_options(out / "resized", 1, max_tokens_per_microbatch=2 * BUDGET))
    trainer = PairDPOTrainer(
        model=tiny_llama(0), args=config, train_dataset=long_pairs(24), processing_class=tiny_tokenizer()
    )
    try:
        trainer.train(resume_from_checkpoint=str(run_dir / "checkpoint-2"))
        code = None
    except PairDPOError as exc:
        code = exc.reason_code
    (out / f"resize_rank{rank}.json").write_text(json.dumps({"reason_code": code}))


def too_long_phase(out: Path, size: int, rank: int) -> None:
    """A group whose row (2 x 20 tokens) is shorter than the long pair (50 tokens shared): the error each rank raises
    when the trainer is built."""
    from pair_dpo_trainer import PairDPOTrainer
    from pair_dpo_trainer.errors import PairDPOError

    config = cpu_config(out, **train_options(out / "too_long", size, max_tokens_per_microbatch=20))
    try:
        PairDPOTrainer(
            model=tiny_llama(0), args=config, train_dataset=long_pairs(24), processing_class=tiny_tokenizer()
        )
        result = {"reason_code": None}
    except PairDPOError as exc:
        result = {"reason_code": exc.reason_code, "message": str(exc)}
    (out / f"too_long_rank{rank}.json").write_text(json.dumps(result))


def main() -> None:
    from pair_dpo_trainer.parallel.collectives import end_process_group

    out, size, phases = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        for phase in phases:
            if phase == "model":
                model_phase(out, size, rank % size)
            elif phase == "compiled":
                compiled_phase(out, size, rank % size)
            elif phase == "train":
                train_phase(out, size, rank)
            elif phase == "resume":
                train_phase(out, size, rank, resume=True)
            elif phase == "precompute":
                precompute_phase(out, size, rank)
            elif phase == "too_long":
                too_long_phase(out, size, rank)
            elif phase == "resize":
                resize_phase(out, rank)
    finally:
        end_process_group()


if __name__ == "__main__":
    main()
