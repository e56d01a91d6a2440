"""Worker for tests/test_progress.py: 2 real processes (ranks with a launcher's environment, gloo on CPU) tokenise raw
rows and evaluate with progress bars enabled; each rank writes its own stderr to OUT_DIR/stderr.<rank> (bars must show
on rank 0 only)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    sys.stderr = open(Path(out_dir) / f"stderr.{rank}", "w", buffering=1)  # noqa: SIM115 (lives as long as the run)
    from transformers import AutoTokenizer

    from pair_dpo_trainer import PairDPOTrainer
    from pair_dpo_trainer.demo import bundled_model_dir
    from pair_dpo_trainer.demo.pairs import generate_demo_pairs
    from tests.dpo_fixtures import cpu_config

    model_dir = str(bundled_model_dir())
    args = cpu_config(Path(out_dir) / f"rank{rank}", disable_tqdm=False, per_device_eval_batch_size=4)
    trainer = PairDPOTrainer(
        model=model_dir,
        args=args,
        train_dataset=generate_demo_pairs(seed=0, n=16),
        eval_dataset=generate_demo_pairs(seed=1, n=16),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )
    trainer.evaluate()
    sys.stderr.flush()


if __name__ == "__main__":
    main(sys.argv[1])
