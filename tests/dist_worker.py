"""Worker for tests/test_distributed.py, launched with 2 real processes (forked ranks or torchrun, gloo on CPU).

Phases (each writes its result under OUT_DIR for the test process to compare):
  Every phase packs each prompt once (``share_prompt``, the default) except dp2_budget, whose budget is sized for
  pairs that pack each prompt twice.
  dp2_ga1 / dp2_ga2: one 5-step training run each (same global batch of 8 pairs as the test's DP=1, GA=2 run);
      rank 0 saves the gradient of the first optimizer step and the loss curve; then an eval over EVAL_PAIRS pairs
      in micro-batches of EVAL_BATCH pairs, whose last step leaves rank 1 a weight-0 filler.
  dp2_ga2_pre: dp2_ga2 with ``precompute_ref_log_probs`` (each rank computes its share, gathered over gloo): the same
      loss curve as dp2_ga2 with the online reference.
  dp2_budget: the same global batch with a token budget (4 pairs per rank per step packed into 2-4 micro-batches of
      <= BUDGET tokens, a varying count): gradients, losses and parameters as DP=1; DDP all-reduces once per step
      (a counting comm hook); then an eval by the same budget over an odd number of pairs (weight-0 fillers).
  disagree: rank 1 loads one pair fewer; both ranks must raise ScheduleError('ranks_disagree'), not hang.
  disagree_rows: each rank reads its own data file, rank 1's with chosen and rejected swapped: every pair costs the
      same on both ranks (the schedules agree), only the rows differ; both ranks must raise 'ranks_disagree'.
  objectives: every objective of :data:`OBJECTIVE_RUNS` (each TRL loss, SimPO, ORPO, mixtures, WPO, LD-DPO,
      f-divergences, TR-DPO) as dp2_ga1, dp2_ga2 and dp2_budget runs of ``OBJECTIVE_STEPS`` steps against a distinct
      reference; rank 0 saves one file per layout with every objective's per-step gradients, losses and parameters.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from pair_dpo_trainer import PairDPOTrainer, ScheduleError
from pair_dpo_trainer.parallel.collectives import end_process_group

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.dpo_fixtures import cpu_config, synthetic_pairs  # noqa: E402
from tests.gc_heap import freeze_import_heap  # noqa: E402
from tests.models import tiny_llama, tiny_tokenizer  # noqa: E402

NUM_PAIRS = 64
GLOBAL_PAIRS = 8
BUDGET = 48  # synthetic pairs cost 11-42 tokens here; the 4 pairs of a rank's step need 2-4 micro-batches of <= 48
EVAL_PAIRS = 13
EVAL_BATCH = 6
"""Fixed-count eval micro-batches: 13 pairs in steps of 2 * 6, so the last step's one pair leaves rank 1 a filler."""
OBJECTIVE_STEPS = 3
"""Enough for BCO's running mean (steps 2-3 use the previous steps' rewards) and TR-DPO syncs (every step)."""
OBJECTIVE_TRAINING = {"optim": "sgd", "learning_rate": 2e-2}
"""Plain SGD for the objective runs: parameters after a step differ exactly as much as the gradients did (Adam's
first steps are sign-like and turn fp noise in near-zero gradients into visible parameter differences)."""

OBJECTIVE_RUNS: dict[str, dict] = {
    **{
        name: {"loss_type": name}
        for name in ("sigmoid", "hinge", "ipo", "ipo_sum", "nca_pair", "bco_pair", "bco_pair_shift")
    },
    **{name: {"loss_type": name} for name in ("sppo_hard", "aot_unpaired", "apo_zero", "apo_down")},
    "aot": {"loss_type": "aot", "pairs": "equal_lengths"},
    **{name: {"loss_type": name} for name in ("discopop", "sigmoid_norm", "sigmoid_nll", "sft", "simpo", "orpo")},
    "robust": {"loss_type": "robust", "label_smoothing": 0.1},
    "exo_pair": {"loss_type": "exo_pair", "label_smoothing": 1e-3},
    "cdpo": {"loss_type": "sigmoid", "label_smoothing": 0.2},
    "mpo": {"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]},
    "wpo": {"loss_type": "sigmoid", "use_weighting": True},
    "ld_dpo": {"loss_type": "sigmoid", "ld_alpha": 0.3},
    "f_js": {"loss_type": ["sigmoid", "ipo"], "f_divergence_type": "js_divergence"},
    "f_alpha": {"loss_type": "hinge", "f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3},
    "tr_dpo": {"loss_type": "sigmoid", "sync_ref_model": True, "ref_model_sync_steps": 1},
}
"""Objective runs of the DP x GA invariance check: name -> PairDPOConfig options."""


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
    """Copies every parameter's gradient just before each optimizer step (after DDP averaging): ``grads`` holds the
    first step's, ``step_grads`` every step's."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}
        self.step_grads: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.step_grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        if state.global_step == 0:
            self.grads = self.step_grads[0]


def build_trainer(
    out_dir: Path, pairs, *, world_size: int, ga: int, max_steps: int, eval_pairs=None, ref_model=None, **kwargs
) -> PairDPOTrainer:
    """``ga=None``: a token budget (``BUDGET``) instead of a fixed number of micro-batches."""
    budget = {"max_tokens_per_microbatch": BUDGET} if ga is None else {}
    options = {"learning_rate": 1e-2, "max_grad_norm": 0.0, **kwargs}
    config = cpu_config(
        out_dir,
        output_dir=str(out_dir),
        max_steps=max_steps,
        per_device_train_batch_size=GLOBAL_PAIRS // (world_size * (ga or 1)),
        gradient_accumulation_steps=ga or 1,
        **budget,
        **options,
    )
    return PairDPOTrainer(
        model=tiny_llama(0),
        args=config,
        train_dataset=pairs,
        eval_dataset=eval_pairs,
        processing_class=tiny_tokenizer(),
        ref_model=ref_model,
    )


def equal_length_pairs(n: int) -> list[dict[str, list[int]]]:
    """:func:`synthetic_pairs` with both completions of a pair cut to the shorter one's length (EOS kept): sequence
    log-probs are then not ordered by length, so policy and reference margins sort differently (paired AOT's
    matching is not the identity)."""
    rows = []
    for row in synthetic_pairs(n):
        length = min(len(row["chosen_input_ids"]), len(row["rejected_input_ids"]))
        chosen, rejected = row["chosen_input_ids"][: length - 1] + [2], row["rejected_input_ids"][: length - 1] + [2]
        rows.append({**row, "chosen_input_ids": chosen, "rejected_input_ids": rejected})
    return rows


def run_layout(
    out_dir: Path, name: str, *, world_size: int, ga: int | None, steps: int = 5, pairs=None, evaluate=True, **kwargs
) -> dict:
    """Trains ``steps`` steps and returns the first-step and per-step gradients, the loss curve, the all-reduces per
    step under DDP and, with a budget, the micro-batch counts of the steps and (``evaluate``) the metrics of an eval
    over ``EVAL_PAIRS`` pairs (fixed count: micro-batches of ``EVAL_BATCH``) with its weight-0 fillers per rank."""
    recorder = FirstStepGradients()
    pairs = synthetic_pairs(NUM_PAIRS) if pairs is None else pairs
    eval_pairs = synthetic_pairs(EVAL_PAIRS, seed=9) if evaluate else None
    if evaluate and ga is not None:
        kwargs.setdefault("per_device_eval_batch_size", EVAL_BATCH)
    trainer = build_trainer(
        out_dir / name, pairs, world_size=world_size, ga=ga, max_steps=steps, eval_pairs=eval_pairs, **kwargs
    )
    trainer.add_callback(recorder)
    counter = AllReduceCounter(trainer)
    if world_size > 1:
        trainer.add_callback(counter)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = {"grads": recorder.grads, "step_grads": recorder.step_grads, "losses": losses, "params": params}
    result["allreduces"] = counter.per_step
    if ga is None:
        result["microbatch_counts"] = trainer._train_sampler.microbatch_counts()[:steps]
    if evaluate:
        result["eval"] = trainer.evaluate()
        result["eval_fillers"] = eval_fillers(trainer)
    return result


def eval_fillers(trainer: PairDPOTrainer) -> list[int]:
    """Weight-0 filler pairs of each rank's eval schedule (the same plan the trainer's eval dataloader ran)."""
    from pair_dpo_trainer.samplers.evaluation import plan_eval

    costs, args = trainer._costs(trainer.eval_dataset), trainer.args
    plans = [
        plan_eval(
            costs,
            world_size=args.world_size,
            rank=rank,
            pairs_per_microbatch=args.per_device_eval_batch_size,
            max_tokens_per_microbatch=args.max_tokens_per_microbatch,
        )
        for rank in range(args.world_size)
    ]
    return [sum(weight == 0.0 for batch in plan for _, weight in batch) for plan in plans]


def objective_options(name: str) -> dict:
    """The run options of one objective: a reference distinct from the policy (tiny_llama(1)) unless it uses none,
    so that log-ratios are not 0 at step 0."""
    from pair_dpo_trainer.losses import REFERENCE_FREE_LOSSES

    options = {**OBJECTIVE_TRAINING, **OBJECTIVE_RUNS[name]}
    if options.pop("pairs", None) == "equal_lengths":
        options["pairs"] = equal_length_pairs(NUM_PAIRS)
    types = options["loss_type"] if isinstance(options["loss_type"], list) else [options["loss_type"]]
    if not set(types) <= REFERENCE_FREE_LOSSES:
        options["ref_model"] = tiny_llama(1)
    return options


def run_objectives(out_dir: Path, *, world_size: int, ga: int | None) -> dict[str, dict]:
    """Every objective of :data:`OBJECTIVE_RUNS` in one layout (``ga=None``: the token budget)."""
    layout = f"dp{world_size}_{'budget' if ga is None else f'ga{ga}'}"
    return {
        name: run_layout(
            out_dir,
            f"obj_{name}_{layout}",
            world_size=world_size,
            ga=ga,
            steps=OBJECTIVE_STEPS,
            evaluate=False,
            **objective_options(name),
        )
        for name in OBJECTIVE_RUNS
    }


def run_disagreement(out_dir: Path, rank: int) -> dict:
    pairs = synthetic_pairs(NUM_PAIRS - rank)
    trainer = build_trainer(out_dir / "disagree", pairs, world_size=2, ga=1, max_steps=1)
    start = time.monotonic()
    try:
        trainer.train()
    except ScheduleError as exc:
        return {"reason_code": exc.reason_code, "message": str(exc), "seconds": time.monotonic() - start}
    return {"reason_code": None, "seconds": time.monotonic() - start}


def run_rows_disagreement(out_dir: Path, rank: int) -> dict:
    import datasets

    rows = synthetic_pairs(NUM_PAIRS)
    if rank == 1:  # a pair costs 2 x prompt + chosen + rejected: the same with its completions swapped
        rows = [{**row, "chosen_input_ids": row["rejected_input_ids"], "rejected_input_ids": row["chosen_input_ids"]}
                for row in rows]  # fmt: skip
    path = out_dir / f"rows_rank{rank}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    pairs = datasets.Dataset.from_json(str(path), cache_dir=str(out_dir / f"datasets_rank{rank}"))
    options = {"dataset_cache_dir": str(out_dir / "disagree_rows_cache")}
    trainer = build_trainer(out_dir / "disagree_rows", pairs, world_size=2, ga=1, max_steps=1, **options)
    try:
        trainer.train()
    except ScheduleError as exc:
        return {"reason_code": exc.reason_code, "message": str(exc)}
    return {"reason_code": None}


def main() -> None:
    out_dir = Path(sys.argv[1])
    rank = int(os.environ["RANK"])  # the process group starts with the first trainer
    if sys.argv[2:] == ["disagree_rows"]:  # this phase alone
        (out_dir / f"disagree_rows_rank{rank}.json").write_text(json.dumps(run_rows_disagreement(out_dir, rank)))
        end_process_group()
        return
    layouts = (
        ("dp2_ga1", 1, {}),
        ("dp2_ga2", 2, {}),
        ("dp2_ga2_pre", 2, {"precompute_ref_log_probs": True}),
        ("dp2_budget", None, {"share_prompt": False}),  # BUDGET needs 2-4 micro-batches of the unshared costs
    )
    for name, ga, options in layouts:
        result = run_layout(out_dir, name, world_size=2, ga=ga, **options)
        if dist.get_rank() == 0:
            torch.save(result, out_dir / f"{name}.pt")
    for layout, ga in (("ga1", 1), ("ga2", 2), ("budget", None)):
        results = run_objectives(out_dir, world_size=2, ga=ga)
        if dist.get_rank() == 0:
            torch.save(results, out_dir / f"objectives_dp2_{layout}.pt")
    (out_dir / f"disagree_rank{rank}.json").write_text(json.dumps(run_disagreement(out_dir, rank)))
    (out_dir / f"disagree_rows_rank{rank}.json").write_text(json.dumps(run_rows_disagreement(out_dir, rank)))
    end_process_group()  # every rank together: a live gloo group at interpreter exit can abort the process


if __name__ == "__main__":
    freeze_import_heap()  # ~120 trainings follow, each starting with a full gc.collect()
    main()
