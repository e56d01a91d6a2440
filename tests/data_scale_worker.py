"""Worker for tests/test_data_scale_dist.py, launched with 2 real processes (torchrun, gloo on CPU), one node.

Phases (each rank writes ``<phase>_rank<r>.json`` under OUT_DIR):
  once: raw rows, ``dataset_num_proc=1``, a pinned reference snapshot: every call of ``tokenize_pair`` and every file
      hashed are counted per rank; then two training steps.
  parallel: raw rows with ``dataset_num_proc=2``.
  bad: a bad row in the second chunk, ``dataset_num_proc=2``: every rank must raise its PreferenceRowError.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoTokenizer  # noqa: E402

from pair_dpo_trainer import PairDPOTrainer  # noqa: E402
from pair_dpo_trainer.data import tokenize  # noqa: E402
from pair_dpo_trainer.demo import DEMO_REVISION, bundled_model_dir  # noqa: E402
from pair_dpo_trainer.demo.pairs import generate_demo_pairs  # noqa: E402
from pair_dpo_trainer.errors import PreferenceRowError  # noqa: E402
from tests.dpo_fixtures import cpu_config  # noqa: E402

CALLS = {"tokenize_pair": 0}
_tokenize_pair = tokenize.tokenize_pair


def _counting_tokenize_pair(*args, **kwargs):
    CALLS["tokenize_pair"] += 1
    return _tokenize_pair(*args, **kwargs)


tokenize.tokenize_pair = _counting_tokenize_pair  # the name tokenize_dataset calls, in this process


def _trainer(out_dir: Path, rows, eval_rows, **options) -> PairDPOTrainer:
    args = cpu_config(
        out_dir,
        output_dir=str(out_dir),
        ref_model_revision=DEMO_REVISION,
        max_length=128,
        max_prompt_length=64,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        max_steps=2,
        **options,
    )
    model = str(bundled_model_dir())
    tok = AutoTokenizer.from_pretrained(model)
    return PairDPOTrainer(model=model, args=args, train_dataset=rows, eval_dataset=eval_rows, processing_class=tok)


def _files(dataset) -> list[str]:
    return [entry["filename"] for entry in dataset.cache_files]


def _meta(filename: str) -> dict:
    return json.loads((Path(filename).parent / "meta.json").read_text())


def run_once(out_dir: Path) -> dict:
    rows, eval_rows = generate_demo_pairs(seed=5, n=300), generate_demo_pairs(seed=6, n=40)
    trainer = _trainer(out_dir, rows, eval_rows, dataset_num_proc=1)
    calls = CALLS["tokenize_pair"]
    source = trainer.reference_source
    result = {
        "tokenize_pair_calls": calls,
        "train_files": _files(trainer.train_dataset),
        "eval_files": _files(trainer.eval_dataset),
        "train_meta": _meta(_files(trainer.train_dataset)[0]),
        "files_hashed": source.files_hashed,
        "snapshot_files": len(source.snapshot.files),
        "manifest_digest": source.snapshot.manifest_digest,
    }
    trainer.train()
    result["losses"] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return result


def run_parallel(out_dir: Path) -> dict:
    before = CALLS["tokenize_pair"]
    trainer = _trainer(out_dir, generate_demo_pairs(seed=7, n=700), None, dataset_num_proc=2)
    return {
        "tokenize_pair_calls": CALLS["tokenize_pair"] - before,
        "train_files": _files(trainer.train_dataset),
        "train_meta": _meta(_files(trainer.train_dataset)[0]),
        "rows": len(trainer.train_dataset),
    }


def run_bad(out_dir: Path) -> dict:
    rows = generate_demo_pairs(seed=8, n=700)
    rows[400] = {"prompt": "x"}  # chunk 1 (rows 256-511), converted by a worker
    try:
        _trainer(out_dir, rows, None, dataset_num_proc=2)
    except PreferenceRowError as exc:
        return {"reason_code": exc.reason_code, "message": exc.message}
    return {"reason_code": None}


def main() -> None:
    out_dir = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    for phase, run in (("once", run_once), ("parallel", run_parallel), ("bad", run_bad)):
        result = {"rank": rank, "pid": os.getpid(), **run(out_dir / f"{phase}_rank{rank}")}
        (out_dir / f"{phase}_rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
