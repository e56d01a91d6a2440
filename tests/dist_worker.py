"""Worker for tests/test_distributed.py, launched with 2 real processes (torchrun, gloo on CPU).

Phases (each writes its result under OUT_DIR for the test process to compare):
  dp2_ga1 / dp2_ga2: one 5-step training run each (same global batch of 8 pairs as the test's DP=1, GA=2 run);
      rank 0 saves the gradient of the first optimizer step and the loss curve.
  dp2_ga2_pre: dp2_ga2 with ``precompute_ref_log_probs`` (each rank computes its share, gathered over gloo): the same
      loss curve as dp2_ga2 with the online reference.
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


class FirstStepGradients(TrainerCallback):
    """Copies every parameter's gradient just before the first optimizer step (after DDP averaging)."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step == 0:
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def build_trainer(out_dir: Path, pairs, *, world_size: int, ga: int, max_steps: int, **kwargs) -> PairDPOTrainer:
    config = cpu_config(
        out_dir,
        output_dir=str(out_dir),
        max_steps=max_steps,
        per_device_train_batch_size=GLOBAL_PAIRS // (world_size * ga),
        gradient_accumulation_steps=ga,
        learning_rate=1e-2,
        max_grad_norm=0.0,
        **kwargs,
    )
    return PairDPOTrainer(model=tiny_llama(0), args=config, train_dataset=pairs, processing_class=tiny_tokenizer())


def run_layout(out_dir: Path, name: str, *, world_size: int, ga: int, **kwargs) -> dict:
    """Trains 5 steps and returns the first-step gradients and the loss curve."""
    recorder = FirstStepGradients()
    pairs = synthetic_pairs(NUM_PAIRS)
    trainer = build_trainer(out_dir / name, pairs, world_size=world_size, ga=ga, max_steps=5, **kwargs)
    trainer.add_callback(recorder)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return {"grads": recorder.grads, "losses": losses, "params": params}


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
    layouts = (("dp2_ga1", 1, {}), ("dp2_ga2", 2, {}), ("dp2_ga2_pre", 2, {"precompute_ref_log_probs": True}))
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
