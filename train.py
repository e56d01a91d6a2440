"""Train pair DPO: ``accelerate launch train.py [flags | config.yaml | config.json]``.

With no arguments it trains the bundled tiny Llama on the bundled demo preference pairs (no downloads) and writes
checkpoints, ``trainer_state.json`` and ``training_curves.png`` into ``outputs/pair-dpo-demo``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoTokenizer, HfArgumentParser

from pair_dpo_trainer import PairDPOConfig, PairDPOTrainer
from pair_dpo_trainer.allocator import default_cuda_allocator
from pair_dpo_trainer.data.splits import load_train_eval
from pair_dpo_trainer.demo import DEMO_REVISION, bundled_model_dir, bundled_pairs_path
from pair_dpo_trainer.modeling.paths import require_model_directory
from pair_dpo_trainer.plotting import CURVES_FILENAME, plot_training_curves

# Defaults of the bundled demo run (any flag overrides them).
DEMO_DEFAULTS = {
    "output_dir": "outputs/pair-dpo-demo",
    "learning_rate": 1e-3,
    "lr_scheduler_type": "cosine",
    "warmup_steps": 10,
    "num_train_epochs": 2.0,
    "per_device_train_batch_size": 8,
    "per_device_eval_batch_size": 32,
    "gradient_accumulation_steps": 2,
    "beta": 0.1,
    "max_length": 128,
    "max_prompt_length": 64,
    "eval_strategy": "steps",
    "eval_on_start": True,
    "eval_steps": 50,
    "logging_steps": 10,
    "save_steps": 100,
    "save_total_limit": 2,
    "report_to": "none",
    "seed": 0,
}


@dataclass
class ModelArguments:
    model_name_or_path: str = field(
        default=str(bundled_model_dir()),
        metadata={"help": "Local directory of the policy (and, by default, of the reference)."},
    )


@dataclass
class DataArguments:
    dataset: str = field(
        default=str(bundled_pairs_path()),
        metadata={"help": "A jsonl/json/parquet file of preference rows, or a `pair-dpo prepare-data` output dir."},
    )
    eval_size: int = field(
        default=200, metadata={"help": "Pairs held out for evaluation when `dataset` is a single file (0: none)."}
    )


def parse_args(argv: list[str]) -> tuple[ModelArguments, DataArguments, PairDPOConfig]:
    """Flags, or a single YAML/JSON file of the same names."""
    parser = HfArgumentParser((ModelArguments, DataArguments, PairDPOConfig))
    parser.set_defaults(**DEMO_DEFAULTS)
    if len(argv) == 1 and argv[0].endswith((".yaml", ".yml")):
        return parser.parse_yaml_file(argv[0])
    if len(argv) == 1 and argv[0].endswith(".json"):
        return parser.parse_json_file(argv[0])
    return parser.parse_args_into_dataclasses(argv)


def _is_bundled(path: str) -> bool:
    return Path(path).resolve() == bundled_model_dir().resolve()


def main(argv: list[str] | None = None) -> dict[str, float]:
    default_cuda_allocator()  # expandable_segments:True unless PYTORCH_CUDA_ALLOC_CONF is set (before CUDA starts)
    model_args, data_args, config = parse_args(sys.argv[1:] if argv is None else argv)
    if _is_bundled(model_args.model_name_or_path) and not config.reference_free and config.ref_model_revision is None:
        config.ref_model_revision = DEMO_REVISION  # the bundled snapshot ships pinned at this revision
    require_model_directory(
        model_args.model_name_or_path, role="policy", option="--model_name_or_path", code="model_not_found"
    )
    train_rows, eval_rows = load_train_eval(data_args.dataset, eval_size=data_args.eval_size, seed=config.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    trainer = PairDPOTrainer(
        model=model_args.model_name_or_path,
        args=config,
        train_dataset=train_rows,
        eval_dataset=eval_rows or None,
        processing_class=tokenizer,
    )
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    metrics = trainer.evaluate() if eval_rows else {}
    trainer.save_model()
    trainer.save_state()
    if trainer.is_world_process_zero():
        plot_training_curves(trainer.state.log_history, f"{config.output_dir}/{CURVES_FILENAME}")
        print({k: round(v, 4) for k, v in metrics.items() if isinstance(v, float)})
    return metrics


if __name__ == "__main__":
    main()
