"""Worker for tests/test_distributed.py, launched with 2 real processes (torchrun, gloo on CPU).

Phases (each writes its result under OUT_DIR for the test process to compare):
  dp2_ga1 / dp2_ga2: one 5-step training run each (same global batch of 8 pairs as the test's DP=1, GA=2 run);
      rank 0 saves the gradient of the first optimizer step and the loss curve.
  dp2_ga2_pre: dp2_ga2 with ``precompute_ref_log_probs`` (each rank computes its share, gathered over gloo): the same
      loss curve as dp2_ga2 with the online reference.
  dp2_budget: the same global batch with a token budget (4 pairs per rank per step packed into 2-4 micro-batches of
      <= BUDGET tokens, a varying count): gradients, losses and parameters as DP=1; DDP all-reduces once per step
      (a counting comm hook); then an eval by the same budget over an odd number of pairs (weight-0 fillers).
  disagree: rank 1 loads one pair fewer; both ranks must raise ScheduleError('ranks_disagree'), not hang.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from pair_dpo_trainer import PairDPOTrainer, ScheduleError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.dpo_fixtures import cpu_config, synthetic_pairs, tiny_llama, tiny_tokenizer  # noqa: E402

NUM_PAIRS = 64
GLOBAL_PAIRS = 8
BUDGET = 48  # synthetic pairs cost 11-42 tokens here; the 4 pairs of a rank's step need 2-4 micro-batches of <= 48
EVAL_PAIRS = 13


class AllReduceCounter(TrainerCallback):
    """Counts DDP's gradient all-reduces (a comm hook on the wrapped model) per optimizer step."""

    def __init__(self, trainer: PairDPOTrainer) -> None:
        self.trainer = trainer
        self.calls = 0
        self.per_step: list[int] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.model_wrapped.register_comm_hook(state=self, hook=_counting_allreduce)

    def on_step_end(self, args, state, control, **kwargs):
        self.per_step.append(self.calls - sum(self.per_step))


def _counting_allreduce(counter: AllReduceCounter, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    counter.calls += 1
    return allreduce_hook(None, bucket)


class FirstStepGradients(TrainerCallback):
    """Copies every parameter's gradient just before the first optimizer step (after DDP averaging)."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step == 0:
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def build_trainer(
    out_dir: Path, pairs, *, world_size: int, ga: int, max_steps: int, eval_pairs=None, **kwargs
) -> PairDPOTrainer:
    """``ga=None``: a token budget (``BUDGET``) instead of a fixed number of micro-batches."""
    budget = {"max_tokens_per_microbatch": BUDGET} if ga is None else {}
    config = cpu_config(
        out_dir,
        output_dir=str(out_dir),
        max_steps=max_steps,
        per_device_train_batch_size=GLOBAL_PAIRS // (world_size * (ga or 1)),
        gradient_accumulation_steps=ga or 1,
        **budget,
        learning_rate=1e-2,
        max_grad_norm=0.0,
        **kwargs,
    )
    return PairDPOTrainer(
        model=tiny_llama(0),
        args=config,
        train_dataset=pairs,
        eval_dataset=eval_pairs,
        processing_class=tiny_tokenizer(),
    )


def run_layout(out_dir: Path, name: str, *, world_size: int, ga: int | None, **kwargs) -> dict:
    """Trains 5 steps and returns the first-step gradients, the loss curve, the all-reduces per step under DDP and,
    with a budget, the micro-batch counts of the steps and the metrics of an eval over ``EVAL_PAIRS`` pairs."""
    recorder = FirstStepGradients()
    pairs = synthetic_pairs(NUM_PAIRS)
    eval_pairs = synthetic_pairs(EVAL_PAIRS, seed=9) if ga is None else None
    trainer = build_trainer(
        out_dir / name, pairs, world_size=world_size, ga=ga, max_steps=5, eval_pairs=eval_pairs, **kwargs
    )
    trainer.add_callback(recorder)
    counter = AllReduceCounter(trainer)
    if world_size > 1:
        trainer.add_callback(counter)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = {"grads": recorder.grads, "losses": losses, "params": params, "allreduces": counter.per_step}
    if ga is None:
        result["microbatch_counts"] = trainer._train_sampler.microbatch_counts()[:5]
        result["eval"] = trainer.evaluate()
    return result


def run_disagreement(out_dir: Path, rank: int) -> dict:
    pairs = synthetic_pairs(NUM_PAIRS - rank)
    trainer = build_trainer(out_dir / "disagree", pairs, world_size=2, ga=1, max_steps=1)
    start = time.monotonic()
    try:
        trainer.train()
    except ScheduleError as exc:
        return {"reason_code": exc.reason_code, "message": str(exc), "seconds": time.monotonic() - start}
    return {"reason_code": None, "seconds": time.monotonic() - start}


def main() -> None:
    out_dir = Path(sys.argv[1])
    layouts = (
        ("dp2_ga1", 1, {}),
        ("dp2_ga2", 2, {}),
        ("dp2_ga2_pre", 2, {"precompute_ref_log_probs": True}),
        ("dp2_budget", None, {}),
    )
    for name, ga, options in layouts:
        result = run_layout(out_dir, name, world_size=2, ga=ga, **options)
        if dist.get_rank() == 0:
            torch.save(result, out_dir / f"{name}.pt")
    rank = dist.get_rank()
    (out_dir / f"disagree_rank{rank}.json").write_text(json.dumps(run_disagreement(out_dir, rank)))
    dist.barrier()
    dist.destroy_process_group()  # a live gloo group at interpreter exit can abort ("terminate called ...")


if __name__ == "__main__":
    main()
