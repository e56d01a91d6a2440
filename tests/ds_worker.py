"""Worker for tests/test_deepspeed.py: DeepSpeed ZeRO-3, 2 real processes on the CPU (``accelerate launch``, gloo).

One launch runs every phase in order (each writes its result under OUT_DIR; the test compares them with single-process
runs without DeepSpeed):

  free / std: reference-free and standard DPO, 6 steps, DP=2 x GA=2 on the same global batch of 8 pairs as the test's
      DP=1 x GA=2 runs. ``std`` also records how the policy and the reference engine are partitioned (and which
      modules are ZeRO-3 leaves), the reference digest before and after training, and saves checkpoint-3.
  noleaf: ``std`` with ``zero3_leaf_modules="none"`` (DeepSpeed's per-submodule hooks, no leaf decoder layers).
  checkpointed: ``std`` with gradient checkpointing (each leaf decoder layer recomputed in backward).
  peft: a LoRA policy (reference = adapters disabled) with the default ``zero3_leaf_modules``: no leaves for PEFT.
  pre: standard DPO with ``precompute_ref_log_probs`` (cache miss: one reference pass, then the reference is freed).
  resume: ``std`` resumed from its checkpoint-3 (online reference).
  pre_resume: the same resume with ``precompute_ref_log_probs`` and pre's cache: a hit, the reference is never built.
  budget: ``std``'s global batch with a token budget (4 pairs per rank per step in 2-4 micro-batches of <= BUDGET
      tokens, a varying count): losses and parameters as DP=1 without DeepSpeed, the engine stepped once per optimizer
      step, then an eval by the same budget over EVAL_PAIRS pairs (weight-0 fillers on the short rank).
  tamper: resume from checkpoint-3 against another reference: ``reference_changed`` on every rank, before any step.
  disagree / disagree_pre: rank 1 loads one pair fewer: ``ranks_disagree`` on every rank within seconds.
  replicated: ``std`` resumed from its checkpoint-3 with ``ref_zero_stage=0`` (the reference a stage 0 engine, whole
      on every rank, the policy still ZeRO-3): the identity check passes, the losses are ``std``'s, and the reference
      log-probs of a fixed batch equal those of ``std``'s sharded reference.
  pre_replicated: ``pre`` with ``ref_zero_stage=0`` and an empty cache directory (the pass runs the replicated
      reference; the cache file has the same key as ``pre``'s).
  pinned / pinned_tamper: policy and reference loaded from a copy of the bundled pinned snapshot (verified on every
      rank, the reference rebuilt model-only from it); the same snapshot once more with ``ref_zero_stage=0`` (the
      policy loaded partitioned, the reference loaded whole, one step); then rank 0 changes the snapshot's weights
      (metadata rewritten consistently) and the resume from checkpoint-2 is refused with ``reference_changed`` on
      every rank.
  sequence_parallel: the two ranks one sequence-parallel group (``sequence_parallel_size=2``) on tests/sp_worker.py's
      pairs, one of them longer than one rank's budget: losses, parameters and an eval as one process without
      DeepSpeed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pair_dpo_trainer import PairDPOError, PairDPOTrainer  # noqa: E402
from pair_dpo_trainer.collators.packed import PackedPairCollator  # noqa: E402
from pair_dpo_trainer.integrity import parameter_digest  # noqa: E402
from pair_dpo_trainer.parallel.collectives import end_process_group  # noqa: E402
from pair_dpo_trainer.parallel.gather import gathered_named_parameters  # noqa: E402
from tests.dpo_fixtures import cpu_config, synthetic_pairs  # noqa: E402
from tests.gc_heap import freeze_import_heap  # noqa: E402
from tests.models import tiny_llama, tiny_lora_llama, tiny_tokenizer  # noqa: E402

NUM_PAIRS = 48
GLOBAL_PAIRS = 8
GA = 2
STEPS = 6
LOGPS_CHUNK = 7
BUDGET = 48  # synthetic pairs cost 11-42 tokens; a rank's 4 pairs of a step need 2-3 micro-batches of <= 48 tokens
EVAL_PAIRS = 13
"""Tiny chunks: each rank's micro-batches score different token counts, so ranks project different numbers of chunks
(the ZeRO-3 head must still be gathered the same number of times on every rank, or the ranks deadlock)."""


def build_trainer(
    out_dir: Path, *, world_size: int, pairs=None, ref_model=None, model=None, **kwargs: Any
) -> PairDPOTrainer:
    """The run every phase and the test's single-process baselines share (fp32, no clipping, constant schedule)."""
    options = dict(
        output_dir=str(out_dir),
        max_steps=STEPS,
        per_device_train_batch_size=GLOBAL_PAIRS // (world_size * GA),
        gradient_accumulation_steps=GA,
        per_device_eval_batch_size=4,
        learning_rate=1e-2,
        max_grad_norm=0.0,
        logps_chunk_size=LOGPS_CHUNK,
        allow_unpinned_reference=not kwargs.get("reference_free", False),
    )
    options.update(kwargs)
    return PairDPOTrainer(
        model=model if model is not None else tiny_llama(0),
        args=cpu_config(out_dir, **options),
        train_dataset=pairs if pairs is not None else synthetic_pairs(NUM_PAIRS),
        processing_class=tiny_tokenizer(),
        ref_model=ref_model,
    )


def losses(trainer: PairDPOTrainer, after: int = 0) -> list[float]:
    """The logged training losses of the steps after ``after`` (a resumed run's history starts with the old steps)."""
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry and entry["step"] > after]


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full value on the CPU (ZeRO-3 parameters gathered one at a time; collective)."""
    named = gathered_named_parameters(model)
    return {name: value.detach().clone() if isinstance(value, torch.Tensor) else value() for name, value in named}


def partitioning(model: torch.nn.Module) -> dict[str, Any]:
    """How many parameters are ZeRO-3 partitioned (a slice per rank, not kept whole) and how many are frozen; which
    modules are ZeRO-3 leaves, and how many modules inside / outside the leaves carry DeepSpeed's forward hooks."""
    params = list(model.parameters())
    sliced = [
        hasattr(p, "ds_tensor") and p.ds_tensor.numel() < p.ds_numel and not getattr(p, "ds_persist", False)
        for p in params
    ]
    leaves = [m for m in model.modules() if getattr(m, "_z3_leaf", False)]
    inside = {id(c) for leaf in leaves for c in leaf.modules() if c is not leaf}
    hooked = [m for m in model.modules() if m._forward_pre_hooks and any(True for _ in m.parameters(recurse=False))]
    return {
        "count": len(params),
        "sliced": sum(sliced),
        "frozen": sum(not p.requires_grad for p in params),
        "leaf_classes": sorted({type(m).__name__ for m in leaves}),
        "leaves": len(leaves),
        "hooked_inside_leaves": sum(id(m) in inside for m in hooked),
        "hooked_outside_leaves": sum(id(m) not in inside for m in hooked),
    }


def reference_logps(trainer: PairDPOTrainer) -> list[float]:
    """The reference's per-sequence log-probs of the first 4 training pairs, packed in one row (collective)."""
    batch = PackedPairCollator()([trainer.train_dataset[i] for i in range(4)])
    return trainer.reference.sequence_logps(batch.to(trainer.args.device)).tolist()


def replication(trainer: PairDPOTrainer) -> dict[str, Any]:
    """What this rank holds of the reference (its engine's stage, ZeRO-3 attributes, elements, frozen-ness) and the
    policy's full element count."""
    reference = trainer.reference
    params = list(reference.model.parameters())
    return {
        "zero_stage": reference.zero_stage,
        "ds_params": sum(hasattr(p, "ds_id") or hasattr(p, "ds_tensor") for p in params),
        "numel": sum(p.numel() for p in params),
        "policy_numel": sum(getattr(p, "ds_numel", p.numel()) for p in trainer.model.parameters()),
        "frozen": sum(not p.requires_grad for p in params),
        "count": len(params),
    }


def run_std(out_dir: Path) -> dict[str, Any]:
    trainer = build_trainer(out_dir / "std", world_size=2, save_strategy="steps", save_steps=3)
    trainer.train()
    reference = trainer.reference
    digest_after = parameter_digest(reference.identity_parameters())
    return {
        "losses": losses(trainer),
        "params": full_parameters(trainer.model),
        "policy_partitioning": partitioning(trainer.model),
        "reference_partitioning": partitioning(reference.model),
        "reference_zero_stage": reference.zero_stage,
        "reference_training": reference.model.training,
        "reference_digest": [trainer.reference_identity.param_digest, digest_after],
        "reference_logps": reference_logps(trainer),
        "identity": trainer.reference_identity.to_dict(),
        "policy_is_engine": type(trainer.model_wrapped).__name__,
    }


def run_noleaf(out_dir: Path) -> dict[str, Any]:
    """``std`` with ``zero3_leaf_modules="none"``: DeepSpeed's per-submodule hooks instead of leaf decoder layers."""
    trainer = _trained(out_dir / "noleaf", zero3_leaf_modules="none")
    return {
        "losses": losses(trainer),
        "params": full_parameters(trainer.model),
        "policy_partitioning": partitioning(trainer.model),
        "reference_partitioning": partitioning(trainer.reference.model),
    }


def run_peft(out_dir: Path) -> dict[str, Any]:
    """A LoRA policy under ZeRO-3 (reference: the policy with adapters disabled), ``zero3_leaf_modules="auto"``."""
    trainer = _trained(out_dir / "peft", model=tiny_lora_llama(0))
    return {
        "losses": losses(trainer),
        "leaf_classes": list(trainer.zero3_leaf_classes),
        "policy_partitioning": partitioning(trainer.model),
    }


def run_replicated(out_dir: Path, std: dict[str, Any]) -> dict[str, Any]:
    """``std`` resumed from checkpoint-3 with a replicated (stage 0) reference, checked against ``std``."""
    trainer = build_trainer(out_dir / "replicated", world_size=2, ref_zero_stage=0)
    trainer.train(resume_from_checkpoint=str(out_dir / "std" / "checkpoint-3"))
    return {
        "losses": losses(trainer, after=3),
        "params": full_parameters(trainer.model),
        "policy_partitioning": partitioning(trainer.model),
        "reference": replication(trainer),
        "reference_logps": reference_logps(trainer),
        "sharded_logps": std["reference_logps"],  # this rank's value from the std phase
        "same_identity": trainer.reference_identity.to_dict() == std["identity"],
    }


def run_budget(out_dir: Path, world_size: int = 2) -> dict[str, Any]:
    """``std`` with a token budget instead of GA=2 (same 8 pairs per step); ``world_size=1``: the test's DP=1 run.
    Each prompt packed twice (``share_prompt=False``): ``BUDGET`` is sized so that those costs need a varying number
    of micro-batches per step (the other runs share prompts, the default)."""
    budget = dict(
        per_device_train_batch_size=GLOBAL_PAIRS // world_size, gradient_accumulation_steps=1, share_prompt=False
    )
    trainer = build_trainer(out_dir / "budget", world_size=world_size, max_tokens_per_microbatch=BUDGET, **budget)
    trainer.train()
    engine = trainer.model_wrapped
    return {
        "losses": losses(trainer),
        "params": full_parameters(trainer.model) if world_size > 1 else dict(trainer.model.named_parameters()),
        "microbatch_counts": trainer._train_sampler.microbatch_counts()[:STEPS],
        "engine_steps": [getattr(engine, "global_steps", None), getattr(engine, "micro_steps", None)],
        "eval": trainer.evaluate(eval_dataset=synthetic_pairs(EVAL_PAIRS, seed=9)),
    }


def run_sequence_parallel(out_dir: Path) -> dict[str, Any]:
    """``sequence_parallel_size=2``: the two ranks hold each row together under ZeRO-3 (tests/sp_worker.py's run:
    a pair longer than one rank's budget included), then an eval by the same budget."""
    from tests.sp_worker import STEPS as SP_STEPS
    from tests.sp_worker import long_pairs, train_options

    options = train_options(out_dir / "sp", 2, save_strategy="no")
    trainer = build_trainer(out_dir / "sp", world_size=2, pairs=long_pairs(24), **options)
    trainer.train()
    return {
        "losses": losses(trainer),
        "params": full_parameters(trainer.model),
        "microbatch_counts": trainer._train_sampler.microbatch_counts()[:SP_STEPS],
        "eval": trainer.evaluate(eval_dataset=synthetic_pairs(EVAL_PAIRS, seed=9)),
    }


def run_resumed(out_dir: Path, name: str, **kwargs: Any) -> dict[str, Any]:
    trainer = build_trainer(out_dir / name, world_size=2, **kwargs)
    trainer.train(resume_from_checkpoint=str(out_dir / "std" / "checkpoint-3"))
    return {
        "losses": losses(trainer, after=3),
        "params": full_parameters(trainer.model),
        "builds": trainer.reference_manager.builds,
    }


def run_failing(
    out_dir: Path, name: str, *, resume: str | None = None, evaluate: Any = None, **kwargs: Any
) -> dict[str, Any]:
    """Builds a trainer and trains it (or evaluates it on the dataset ``evaluate``); the run must fail with a reason
    code, at construction (``step`` None) or later."""
    start = time.monotonic()
    trainer = None
    try:
        trainer = build_trainer(out_dir / name, world_size=2, **kwargs)
        trainer.evaluate(evaluate) if evaluate is not None else trainer.train(resume_from_checkpoint=resume)
    except PairDPOError as exc:
        seconds, step = time.monotonic() - start, trainer.state.global_step if trainer is not None else None
        return {"reason_code": exc.reason_code, "message": str(exc), "seconds": seconds, "step": step}
    return {"reason_code": None, "seconds": time.monotonic() - start}


def run_compile_refused(out_dir: Path) -> dict[str, Any]:
    """``torch_compile=True`` under ZeRO-3 is refused when the trainer is built (on every rank, no collective)."""
    try:
        build_trainer(out_dir / "compile", world_size=2, torch_compile=True, torch_compile_backend="aot_eager")
    except PairDPOError as exc:
        return {"reason_code": exc.reason_code, "message": str(exc), "problems": getattr(exc, "problems", None)}
    return {"reason_code": None}


def main() -> None:
    out_dir = Path(sys.argv[1])
    rank = int(os.environ["RANK"])  # the process group starts with the first trainer
    results: dict[str, Any] = {"timings": {}}

    def timed(name: str, fn, *args: Any, **kwargs: Any) -> None:
        start = time.monotonic()
        results[name] = fn(*args, **kwargs)
        results["timings"][name] = round(time.monotonic() - start, 2)

    timed("free", lambda: {"losses": losses(_trained(out_dir / "free", reference_free=True))})
    timed("std", run_std, out_dir)
    timed("noleaf", run_noleaf, out_dir)
    timed("checkpointed", lambda: {"losses": losses(_trained(out_dir / "gc", gradient_checkpointing=True))})
    cache = str(out_dir / "ref_logps_cache")
    timed("pre", lambda: _pre(out_dir, cache))
    timed("resume", run_resumed, out_dir, "resume")
    timed("pre_resume", run_resumed, out_dir, "pre_resume", precompute_ref_log_probs=True, ref_logps_cache_dir=cache)
    timed("replicated", run_replicated, out_dir, results["std"])
    replicated_cache = str(out_dir / "cache_replicated")
    timed("pre_replicated", lambda: _pre(out_dir / "pre_replicated", replicated_cache, ref_zero_stage=0))
    checkpoint = str(out_dir / "std" / "checkpoint-3")
    timed("budget", run_budget, out_dir)
    timed("tamper", run_failing, out_dir, "tamper", resume=checkpoint, ref_model=tiny_llama(1))
    short = synthetic_pairs(NUM_PAIRS - rank)
    timed("disagree", run_failing, out_dir, "disagree", pairs=short)
    timed("disagree_pre", run_failing, out_dir, "disagree_pre", pairs=short, precompute_ref_log_probs=True)
    timed("pinned", run_pinned, out_dir, rank)
    timed("compile", run_compile_refused, out_dir)
    timed("peft", run_peft, out_dir)
    timed("sequence_parallel", run_sequence_parallel, out_dir)
    replicated = {k: v for k, v in results["replicated"].items() if k != "params"}
    per_rank = {k: results[k] for k in ("tamper", "disagree", "disagree_pre", "pinned", "compile")}
    per_rank["replicated"] = replicated
    (out_dir / f"errors_rank{rank}.json").write_text(json.dumps(per_rank))
    if rank == 0:
        torch.save(results, out_dir / "results.pt")
    end_process_group()  # every rank together: a live gloo group at interpreter exit can abort the process


def run_pinned(out_dir: Path, rank: int) -> dict[str, Any]:
    """Pinned snapshot, 2 steps with a checkpoint; 1 step with a replicated reference (``ref_zero_stage=0``) loaded
    whole from the same snapshot; then a resume against a changed snapshot (refused)."""
    import torch.distributed as dist

    from pair_dpo_trainer.demo import DEMO_REVISION
    from tests.test_reference_gate import _copy_snapshot

    snapshot = out_dir / "snapshot"
    if rank == 0:
        _copy_snapshot(out_dir, "snapshot")
    dist.barrier()
    snapshot_options = dict(model=str(snapshot), ref_model_revision=DEMO_REVISION)
    options = dict(snapshot_options, save_strategy="steps", save_steps=2)
    trainer = build_trainer(out_dir / "pinned", world_size=2, max_steps=2, **options)
    loaded_partitioned = all(hasattr(p, "ds_id") for p in trainer.model.parameters())
    trainer.train()
    result = {
        "losses": losses(trainer),
        "loaded_partitioned": loaded_partitioned,
        "reference_partitioning": partitioning(trainer.reference.model),
        "identity_pinned": trainer.reference_identity.pinned,
    }
    sharded_logps = reference_logps(trainer)
    replicated = dict(snapshot_options, max_steps=1, ref_zero_stage=0)
    trainer = build_trainer(out_dir / "pinned_replicated", world_size=2, **replicated)
    loaded_partitioned = all(hasattr(p, "ds_id") for p in trainer.model.parameters())
    trainer.train()
    result["replicated"] = {
        "losses": losses(trainer),
        "loaded_partitioned": loaded_partitioned,
        "reference": replication(trainer),
        "reference_logps": reference_logps(trainer),
        "sharded_logps": sharded_logps,
    }
    result["tamper"] = resume_reweighted(out_dir, snapshot, rank, options)
    return result


def resume_reweighted(out_dir: Path, snapshot: Path, rank: int, options: dict[str, Any]) -> dict[str, Any]:
    """Rank 0 changes the snapshot's weights (metadata rewritten consistently, so it still verifies); the resume of
    the ``pinned`` run from its checkpoint-2 must then be refused (:func:`run_failing`'s result)."""
    import torch.distributed as dist

    from tests.test_reference_gate import _reweight

    dist.barrier()  # rank 1 may still read its replicated reference, whose weights can be mmap-backed by the file
    if rank == 0:
        _reweight(snapshot, scale=1.5)  # rewrites model.safetensors in place
    dist.barrier()
    checkpoint = str(out_dir / "pinned" / "checkpoint-2")
    return run_failing(out_dir, "pinned", resume=checkpoint, max_steps=4, **options)


def _trained(out_dir: Path, **kwargs: Any) -> PairDPOTrainer:
    trainer = build_trainer(out_dir, world_size=2, **kwargs)
    trainer.train()
    return trainer


def _pre(out_dir: Path, cache: str, **kwargs: Any) -> dict[str, Any]:
    trainer = _trained(out_dir / "pre", precompute_ref_log_probs=True, ref_logps_cache_dir=cache, **kwargs)
    return {
        "losses": losses(trainer),
        "builds": trainer.reference_manager.builds,
        "backend": type(trainer.reference).__name__,
        "cache_files": sorted(p.name for p in Path(cache).glob("ref_logps-*.pt")),
    }


if __name__ == "__main__":
    freeze_import_heap()  # several trainings follow, each starting with a full gc.collect()
    main()
