"""Worker for tests/test_fsdp2.py: FSDP2 (``fully_shard``) through Accelerate, 2 real processes on the CPU (gloo).

Phases (each writes its result under OUT_DIR; the test compares them with single-process runs without FSDP):

  args_fsdp: ``fsdp="full_shard"``, ``fsdp_config={"fsdp_version": 2}`` as TrainingArguments (the issue's report):
      the policy's parameters must be DTensors sharded over the two ranks, not a DDP replica.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pair_dpo_trainer import PairDPOTrainer  # noqa: E402
from tests.dpo_fixtures import cpu_config, synthetic_pairs, tiny_llama, tiny_tokenizer  # noqa: E402

NUM_PAIRS = 48
GLOBAL_PAIRS = 8
GA = 2
STEPS = 6
LOGPS_CHUNK = 7


def build_trainer(out_dir: Path, *, world_size: int, model=None, **kwargs: Any) -> PairDPOTrainer:
    """The run every phase and the test's single-process baselines share (fp32, no clipping, constant schedule)."""
    options = dict(
        output_dir=str(out_dir),
        max_steps=STEPS,
        per_device_train_batch_size=GLOBAL_PAIRS // (world_size * GA),
        gradient_accumulation_steps=GA,
        per_device_eval_batch_size=4,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        logps_chunk_size=LOGPS_CHUNK,
    )
    options.update(kwargs)
    return PairDPOTrainer(
        model=model if model is not None else tiny_llama(0),
        args=cpu_config(out_dir, **options),
        train_dataset=synthetic_pairs(NUM_PAIRS),
        processing_class=tiny_tokenizer(),
    )


def losses(trainer: PairDPOTrainer, after: int = 0) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry and entry["step"] > after]


def sharding(model: torch.nn.Module) -> dict[str, Any]:
    """How this rank holds ``model``'s parameters: how many are DTensors, and how many of those hold a strict slice."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    dtensors = [p for p in params if isinstance(p, DTensor)]
    return {
        "count": len(params),
        "dtensor": len(dtensors),
        "sliced": sum(p.to_local().numel() < p.numel() for p in dtensors),
        "frozen": sum(not p.requires_grad for p in params),
        "wrapper": type(model).__name__,
    }


def run_args_fsdp(out_dir: Path) -> dict[str, Any]:
    trainer = build_trainer(
        out_dir / "args_fsdp", world_size=2, max_steps=2, fsdp="full_shard", fsdp_config={"fsdp_version": 2}
    )
    trainer.train()
    return {
        "losses": losses(trainer),
        "policy": sharding(trainer.model),
        "wrapped": type(trainer.model_wrapped).__name__,
    }


def main() -> None:
    out_dir = Path(sys.argv[1])
    results: dict[str, Any] = {"args_fsdp": run_args_fsdp(out_dir)}
    if int(os.environ["RANK"]) == 0:
        torch.save(results, out_dir / "results.pt")
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
