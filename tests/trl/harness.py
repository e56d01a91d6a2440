"""TRL 1.16's ``DPOTrainer`` and ``PairDPOTrainer`` trained side by side on the same model, rows and settings.

Both start from the bundled tiny Llama (:func:`tests.models.demo_llama`, float32, its tokenizer with a chat template)
and train ``STEPS`` optimizer steps with AdamW at a large learning rate (so the trajectories move) on the same pairs.
Each step takes every pair once: one micro-batch of all ``len(rows)`` pairs, so both see the same pairs per step
(TRL's random order within the batch changes nothing). What each run logged at each step is returned as a
:class:`Trajectory`; the tests compare them.
"""

from __future__ import annotations

import functools
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STEPS = 3
LEARNING_RATE = 5e-4
SHARED_METRICS = (
    "loss",
    "grad_norm",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
    "entropy",
    "mean_token_accuracy",
    "num_tokens",
)
"""The metrics both trainers log under the same name for the same quantity."""


@dataclass(frozen=True)
class Trajectory:
    """What one run logged: one dict of metrics per optimizer step (TRL's / ours, rounded nowhere)."""

    steps: tuple[dict[str, float], ...]

    def values(self, name: str) -> list[float]:
        """The metric ``name`` at every step."""
        return [step[name] for step in self.steps]

    @property
    def names(self) -> set[str]:
        """Every metric name logged at the first step."""
        return set(self.steps[0])


def _logged(log_history: list[dict[str, Any]]) -> Trajectory:
    steps = [
        {key: float(value) for key, value in entry.items() if isinstance(value, (int, float))}
        for entry in log_history
        if "loss" in entry and "train_loss" not in entry
    ]
    for step in steps:
        step.pop("step", None)
        step.pop("epoch", None)
        step.pop("learning_rate", None)
    return Trajectory(tuple(steps))


def _common(out: str, rows: int) -> dict[str, Any]:
    return {
        "output_dir": out,
        "report_to": "none",
        "max_steps": STEPS,
        "per_device_train_batch_size": rows,
        "gradient_accumulation_steps": 1,
        "learning_rate": LEARNING_RATE,
        "logging_steps": 1,
        "save_strategy": "no",
        "use_cpu": True,
        "bf16": False,
        "disable_tqdm": True,
        "seed": 0,
    }


def train_trl(rows: list[dict], options: dict[str, Any], *, lora: bool = False) -> Trajectory:
    """TRL 1.16's ``DPOTrainer`` on ``rows`` with ``options`` (its ``DPOConfig`` fields)."""
    import datasets
    from trl import DPOConfig, DPOTrainer

    from tests.models import demo_llama, lora_config

    model, tokenizer = demo_llama()
    with tempfile.TemporaryDirectory() as out:
        config = DPOConfig(**_common(out, len(rows)), gradient_checkpointing=False, **options)
        datasets.disable_progress_bars()
        try:
            adapters = {"peft_config": lora_config()} if lora else {}
            trainer = DPOTrainer(
                model=model,
                args=config,
                train_dataset=datasets.Dataset.from_list(rows),
                processing_class=tokenizer,
                **adapters,
            )
            trainer.train()
        finally:
            datasets.enable_progress_bars()
        return _logged(trainer.state.log_history)


def train_ours(rows: list[dict], options: dict[str, Any], *, lora: bool = False) -> tuple[Trajectory, str]:
    """``PairDPOTrainer`` on ``rows`` with ``options``; also returns the run summary it printed."""
    import contextlib
    import io

    from pair_dpo_trainer import PairDPOConfig, PairDPOTrainer
    from tests.models import demo_llama, lora_config

    model, tokenizer = demo_llama()
    with tempfile.TemporaryDirectory() as out:
        config = PairDPOConfig(**_common(out, len(rows)), allow_unpinned_reference=True, **options)
        printed = io.StringIO()
        adapters = {"peft_config": lora_config()} if lora else {}
        trainer = PairDPOTrainer(model=model, args=config, train_dataset=rows, processing_class=tokenizer, **adapters)
        with contextlib.redirect_stdout(printed):
            trainer.train()
        return _logged(trainer.state.log_history), printed.getvalue()


LOSS_OPTIONS: dict[str, dict[str, Any]] = {
    "exo_pair": {"label_smoothing": 1e-3},  # EXO needs eps > 0 (the paper's value)
    "robust": {"label_smoothing": 0.1},
}
"""The options a ``loss_type`` needs to run at all, given to both trainers with it."""


def options_for(loss_type: list[str], **options: Any) -> dict[str, Any]:
    """``loss_type`` with the options its objectives need (:data:`LOSS_OPTIONS`) under ``options``."""
    needed: dict[str, Any] = {}
    for name in loss_type:
        needed.update(LOSS_OPTIONS.get(name, {}))
    return {**needed, **options, "loss_type": list(loss_type)}


@functools.cache
def both(rows_name: str, trl_json: str, ours_json: str, lora: bool = False) -> tuple[Trajectory, Trajectory, str]:
    """``(TRL's, ours, our run summary)`` for the named rows (:data:`ROWS`) and each side's options (JSON, so runs
    are cached and shared between tests)."""
    rows = ROWS[rows_name]()
    ours, summary = train_ours(rows, json.loads(ours_json), lora=lora)
    return train_trl(rows, json.loads(trl_json), lora=lora), ours, summary


def run(
    rows_name: str, trl: dict[str, Any], ours: dict[str, Any] | None = None, *, lora: bool = False
) -> tuple[Trajectory, Trajectory, str]:
    """:func:`both` with the options as dicts (``ours`` defaults to TRL's)."""
    ours = trl if ours is None else ours
    return both(rows_name, json.dumps(trl, sort_keys=True), json.dumps(ours, sort_keys=True), lora)


def same(trl: Trajectory, ours: Trajectory, names: tuple[str, ...] = SHARED_METRICS, rel: float = 1e-4) -> list[str]:
    """The metrics of ``names`` that differ between the runs at some step (relative ``rel``, absolute 1e-6, 1e-5 for
    the mean logits; ``num_tokens`` exactly): empty when the runs agree.

    The mean logits are means over every vocabulary entry of values of order 1 that nearly cancel (they log about
    1e-3): float32 summation order moves them by about 1e-6 absolute, which is a large relative change.
    """
    differ = []
    for name in names:
        floor = 1e-5 if name.startswith("logits/") else 1e-6
        for theirs, mine in zip(trl.values(name), ours.values(name), strict=True):
            exact = name == "num_tokens"
            if (theirs != mine) if exact else abs(theirs - mine) > max(rel * abs(theirs), floor):
                differ.append(name)
                break
    return differ


def _demo_rows(n: int = 16) -> list[dict]:
    """``n`` demo pairs as conversations: ``prompt`` / ``chosen`` / ``rejected`` message lists."""
    path = Path(__file__).resolve().parents[2] / "pair_dpo_trainer" / "assets" / "demo_pairs.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()[:n]]


def string_rows() -> list[dict]:
    """The demo pairs as three plain strings (the completion after a space)."""
    return [
        {
            "prompt": row["prompt"][0]["content"],
            "chosen": " " + row["chosen"][0]["content"],
            "rejected": " " + row["rejected"][0]["content"],
        }
        for row in _demo_rows()
    ]


def conversational_rows() -> list[dict]:
    """The demo pairs as conversations."""
    return _demo_rows()


def implicit_string_rows() -> list[dict]:
    """Only ``chosen`` / ``rejected``, each the prompt text followed by its completion (TRL's implicit prompt)."""
    return [
        {"chosen": row["prompt"] + row["chosen"], "rejected": row["prompt"] + row["rejected"]} for row in string_rows()
    ]


def implicit_conversational_rows() -> list[dict]:
    """Only ``chosen`` / ``rejected``, each the whole conversation (the prompt turns repeated)."""
    return [
        {"chosen": row["prompt"] + row["chosen"], "rejected": row["prompt"] + row["rejected"]}
        for row in conversational_rows()
    ]


ROWS = {
    "strings": string_rows,
    "conversations": conversational_rows,
    "implicit strings": implicit_string_rows,
    "implicit conversations": implicit_conversational_rows,
}
"""The row shapes the suite trains on, by name."""
