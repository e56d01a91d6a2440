"""Worker for tests/test_fsdp2.py: FSDP2 (``fully_shard``) through Accelerate, 2 real processes on the CPU (gloo).

Launched once with ``accelerate launch`` and the shipped ``accelerate_configs/fsdp2.yaml`` in its CPU form (2
processes, fp32): the phases without their own ``fsdp`` arguments use that config's plugin (SHARDED_STATE_DICT).
Each phase writes its result under OUT_DIR; the test compares them with single-process runs without FSDP.

  std: standard DPO, 6 steps, DP=2 x GA=2 on the same global batch of 8 pairs as the test's DP=1 x GA=2 runs; the
      first step's full gradients, the losses and final parameters; how policy and reference are held (DTensor
      slices, frozen); the reference digest before and after training; checkpoint-3 (sharded); the final
      ``save_model`` (full safetensors weights).
  args_fsdp: ``fsdp="full_shard"``, ``fsdp_config={"fsdp_version": 2}`` as TrainingArguments (the issue's report,
      which trained plain DDP): 2 steps.
  free: reference-free. tied: a model with tied input/output embeddings. clip: gradient clipping that clips.
      bf16: bf16 mixed precision (the head's log-probs stay float32; the reference computes what the policy does).
      peft: a LoRA policy (adapters disabled as the reference). ac: FSDP's activation checkpointing.
  resume: ``std`` resumed from its checkpoint-3. replicated: the same resume with ``ref_fsdp_shard=False``.
  pre / pre_resume: precomputed reference log-probs (a cache miss, then a resume that hits the cache).
  full_state: FULL_STATE_DICT checkpoints (the TrainingArguments default): 4 steps, then a resume from step 2.
  compile: ``torch_compile=True`` (regional, dynamo's eager backend, a traceable varlen kernel on the CPU).
  tamper / fsdp1 / eval_first / peft_pre: refused on every rank (``reference_changed``, ``fsdp1_unsupported``,
      ``unsupported_combination`` for evaluate() before train() and for a precomputed PEFT reference).
  pinned: policy and reference from a pinned snapshot (verified, identity pinned); a changed snapshot is refused on
      resume (``reference_changed``, the manifest).
  gc: the Trainer's gradient checkpointing (transformers' per-layer checkpointing) under FSDP2.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaForCausalLM, TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pair_dpo_trainer.integrity import parameter_digest  # noqa: E402
from pair_dpo_trainer.parallel.collectives import end_process_group  # noqa: E402
from pair_dpo_trainer.parallel.gather import CHECKPOINT_WRAPPER_PREFIX  # noqa: E402
from tests.dpo_fixtures import synthetic_pairs  # noqa: E402
from tests.ds_worker import (  # noqa: E402
    LOGPS_CHUNK,
    build_trainer,
    full_parameters,
    losses,
    reference_logps,
    resume_reweighted,
    run_failing,
)
from tests.gc_heap import freeze_import_heap  # noqa: E402
from tests.models import tiny_llama, tiny_lora_llama  # noqa: E402

# The ZeRO-3 worker's run (tests/ds_worker.py): 48 pairs, 6 steps of 8 pairs in 2 micro-batches per rank, fp32, no
# clipping, log-prob chunks of 7 tokens (ranks project different numbers of chunks: the sharded head must still be
# all-gathered the same number of times on every rank).

ARGS_FSDP = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2}}
CLIP = {"max_grad_norm": 0.1, "max_steps": 3}
"""Gradient clipping that clips (the tiny model's gradient norms are ~0.5): Accelerate's DTensor-aware norm."""


class FirstStepGradients(TrainerCallback):
    """Every parameter's full gradient just before the first optimizer step (FSDP2 shards gathered; collective)."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step == 0:
            grads = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
            self.grads = {name.replace(CHECKPOINT_WRAPPER_PREFIX, ""): _full(grad) for name, grad in grads}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    value = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return value.detach().to("cpu", copy=True)


def tiny_tied_llama(seed: int = 0) -> LlamaForCausalLM:
    """:func:`tiny_llama` with the LM head tied to the input embedding (one shared weight)."""
    config = tiny_llama(seed).config
    config.tie_word_embeddings = True
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def trained(out_dir: Path, *, world_size: int = 2, resume: str | None = None, **kwargs: Any):
    """Trains and returns ``(trainer, first-step gradients)``."""
    recorder = FirstStepGradients()
    trainer = build_trainer(out_dir, world_size=world_size, **kwargs)
    trainer.add_callback(recorder)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, recorder.grads


def sharding(model: torch.nn.Module) -> dict[str, Any]:
    """How this rank holds ``model``'s parameters: DTensors, of which strict slices, frozen ones, gradients."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    dtensors = [p for p in params if isinstance(p, DTensor)]
    return {
        "count": len(params),
        "dtensor": len(dtensors),
        "sliced": sum(p.to_local().numel() < p.numel() for p in dtensors),
        "local_numel": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params),
        "numel": sum(p.numel() for p in params),
        "frozen": sum(not p.requires_grad for p in params),
        "grads": sum(p.grad is not None for p in params),
        "wrapper": type(model).__name__,
    }


def run_std(out_dir: Path) -> dict[str, Any]:
    trainer, grads = trained(out_dir / "std", save_strategy="steps", save_steps=3)
    reference = trainer.reference
    digest_after = parameter_digest(reference.identity_parameters())
    trainer.save_model(str(out_dir / "std" / "final"))
    return {
        "losses": losses(trainer),
        "grads": grads,
        "params": full_parameters(trainer.model),
        "policy": sharding(trainer.model),
        "reference": sharding(reference.model),
        "reference_training": reference.model.training,
        "reference_digest": [trainer.reference_identity.param_digest, digest_after],
        "reference_logps": reference_logps(trainer),
        "identity": trainer.reference_identity.to_dict(),
        "plugin_state_dict_type": str(trainer.fsdp_plugin.state_dict_type),
        "checkpoint_files": sorted(p.name for p in (out_dir / "std" / "checkpoint-3").iterdir()),
        "final_files": sorted(p.name for p in (out_dir / "std" / "final").iterdir()),
    }


def run_args_fsdp(out_dir: Path) -> dict[str, Any]:
    trainer, _ = trained(out_dir / "args_fsdp", max_steps=2, **ARGS_FSDP)
    return {
        "losses": losses(trainer),
        "policy": sharding(trainer.model),
        "reference": sharding(trainer.reference.model),
    }


def run_bf16(out_dir: Path) -> dict[str, Any]:
    """bf16 mixed precision (fp32 master weights, bf16 compute and reduce-scatter; bf16 runs on the CPU and gloo)."""
    from pair_dpo_trainer.collators.packed import PackedPairCollator
    from pair_dpo_trainer.modeling.logprobs import packed_sequence_logps

    trainer, _ = trained(out_dir / "bf16", max_steps=2, bf16=True)
    batch = PackedPairCollator()([trainer.train_dataset[i] for i in range(4)]).to(trainer.args.device)
    with torch.no_grad():
        policy_logps = packed_sequence_logps(trainer.model, batch, chunk_size=LOGPS_CHUNK)
    policy = trainer.fsdp_plugin.mixed_precision_policy
    return {
        "losses": losses(trainer),
        "policy_logps_dtype": str(policy_logps.dtype),
        "param_dtype": str(policy.param_dtype),
        "output_dtype": str(policy.output_dtype),
        "reference_param_dtypes": sorted({str(p.dtype) for p in trainer.reference.model.parameters()}),
        "reference_buffer_dtypes": sorted({str(b.dtype) for b in trainer.reference.model.buffers()}),
    }


def run_variant(out_dir: Path, name: str, **kwargs: Any) -> dict[str, Any]:
    trainer, grads = trained(out_dir / name, **kwargs)
    return {
        "losses": losses(trainer),
        "grads": grads,
        "policy": sharding(trainer.model),
        "params": full_parameters(trainer.model),
        "grad_norms": [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry],
    }


def run_resumed(out_dir: Path, name: str, **kwargs: Any) -> dict[str, Any]:
    trainer, _ = trained(out_dir / name, resume=str(out_dir / "std" / "checkpoint-3"), **kwargs)
    return {
        "losses": losses(trainer, after=3),
        "params": full_parameters(trainer.model),
        "builds": trainer.reference_manager.builds,
        "reference": sharding(trainer.reference.model) if trainer.reference.model is not None else None,
        "reference_logps": reference_logps(trainer) if trainer.reference.model is not None else None,
        "identity": trainer.reference_identity.to_dict(),
    }


def run_pre(out_dir: Path, cache: str) -> dict[str, Any]:
    trainer, _ = trained(out_dir / "pre", precompute_ref_log_probs=True, ref_logps_cache_dir=cache)
    return {
        "losses": losses(trainer),
        "builds": trainer.reference_manager.builds,
        "backend": type(trainer.reference).__name__,
        "cache_files": sorted(p.name for p in Path(cache).glob("ref_logps-*.pt")),
    }


def run_full_state(out_dir: Path) -> dict[str, Any]:
    """FULL_STATE_DICT checkpoints (rank 0 writes whole weights and optimizer state) resume exactly too."""
    fsdp = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, "state_dict_type": "FULL_STATE_DICT"}}
    options = dict(fsdp, max_steps=4, save_strategy="steps", save_steps=2)
    straight, _ = trained(out_dir / "full_state", **options)
    files = sorted(p.name for p in (out_dir / "full_state" / "checkpoint-2").iterdir())
    resumed, _ = trained(out_dir / "full_state_resume", resume=str(out_dir / "full_state" / "checkpoint-2"), **options)
    return {
        "losses": losses(straight, after=2),
        "resumed_losses": losses(resumed, after=2),
        "params": full_parameters(straight.model),
        "resumed_params": full_parameters(resumed.model),
        "checkpoint_files": files,
    }


def run_compile(out_dir: Path) -> dict[str, Any]:
    """Regional compile (aot_eager) under FSDP2 against the same run in eager mode, both with a traceable varlen
    kernel standing in for the CUDA one (``testing.cpu_varlen.install_traceable_varlen``)."""
    from pair_dpo_trainer.modeling.compile import is_compiled
    from pair_dpo_trainer.testing.cpu_varlen import install_traceable_varlen

    patch = _Patch()
    backend = install_traceable_varlen(patch)
    try:
        options = dict(max_steps=2, attn_backend=backend, torch_compile=True, torch_compile_backend="eager")
        compiled, _ = trained(out_dir / "compiled", **options)
        return {
            "compiled": losses(compiled),
            "policy_compiled": is_compiled(compiled.model),
            "reference_compiled": is_compiled(compiled.reference.model),
            "reference": sharding(compiled.reference.model),
        }
    finally:
        patch.undo()


class _Patch:
    """The two ``monkeypatch`` methods ``install_traceable_varlen`` uses, for a process without pytest."""

    def __init__(self) -> None:
        self._undo: list[Any] = []

    def setattr(self, target: Any, name: str, value: Any) -> None:
        old = getattr(target, name)
        self._undo.append(lambda: setattr(target, name, old))
        setattr(target, name, value)

    def setitem(self, mapping: dict, key: Any, value: Any) -> None:
        missing = object()
        old = mapping.get(key, missing)
        self._undo.append(lambda: mapping.pop(key) if old is missing else mapping.__setitem__(key, old))
        mapping[key] = value

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()


def run_pinned(out_dir: Path, rank: int) -> dict[str, Any]:
    """Policy and reference from a copy of the bundled pinned snapshot (verified on every rank before any weight
    loads; the sharded reference rebuilt from it); then rank 0 changes the snapshot's weights (metadata rewritten
    consistently) and the resume from checkpoint-2 is refused with ``reference_changed`` on every rank."""
    import torch.distributed as dist

    from pair_dpo_trainer.demo import DEMO_REVISION
    from tests.test_reference_gate import _copy_snapshot

    snapshot = out_dir / "snapshot"
    if rank == 0:
        _copy_snapshot(out_dir, "snapshot")
    dist.barrier()
    options = dict(model=str(snapshot), ref_model_revision=DEMO_REVISION, save_strategy="steps", save_steps=2)
    trainer, _ = trained(out_dir / "pinned", max_steps=2, **options)
    result = {
        "losses": losses(trainer),
        "reference": sharding(trainer.reference.model),
        "identity": trainer.reference_identity.to_dict(),
    }
    result["tamper"] = resume_reweighted(out_dir, snapshot, rank, options)
    return result


def main() -> None:
    out_dir = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    results: dict[str, Any] = {"timings": {}}

    def timed(name: str, fn, *args: Any, **kwargs: Any) -> None:
        start = time.monotonic()
        results[name] = fn(*args, **kwargs)
        results["timings"][name] = round(time.monotonic() - start, 2)
        if rank == 0:
            print(f"[fsdp_worker] {name}: {results['timings'][name]} s", flush=True)

    timed("std", run_std, out_dir)
    timed("args_fsdp", run_args_fsdp, out_dir)
    timed("free", run_variant, out_dir, "free", reference_free=True)
    timed("tied", run_variant, out_dir, "tied", model=tiny_tied_llama(0))
    timed("peft", run_variant, out_dir, "peft", model=tiny_lora_llama(0))
    ac = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, "activation_checkpointing": True}}
    timed("ac", run_variant, out_dir, "ac", **ac)
    timed("gc", run_variant, out_dir, "gc", gradient_checkpointing=True)
    timed("clip", run_variant, out_dir, "clip", **CLIP)
    timed("bf16", run_bf16, out_dir)
    timed("resume", run_resumed, out_dir, "resume")
    timed("replicated", run_resumed, out_dir, "replicated", ref_fsdp_shard=False)
    cache = str(out_dir / "ref_logps_cache")
    timed("pre", run_pre, out_dir, cache)
    timed("pre_resume", run_resumed, out_dir, "pre_resume", precompute_ref_log_probs=True, ref_logps_cache_dir=cache)
    timed("full_state", run_full_state, out_dir)
    timed("compile", run_compile, out_dir)
    checkpoint = str(out_dir / "std" / "checkpoint-3")
    timed("tamper", run_failing, out_dir, "tamper", resume=checkpoint, ref_model=tiny_llama(1))
    fsdp1 = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 1}}
    timed("fsdp1", run_failing, out_dir, "fsdp1", **fsdp1)
    timed("eval_first", run_failing, out_dir, "eval_first", evaluate=synthetic_pairs(8, seed=1))
    timed("peft_pre", run_failing, out_dir, "peft_pre", model=tiny_lora_llama(0), precompute_ref_log_probs=True)
    timed("pinned", run_pinned, out_dir, rank)
    per_rank = {k: results[k] for k in ("tamper", "fsdp1", "eval_first", "peft_pre", "pinned")}
    per_rank["reference_logps"] = {k: results[k]["reference_logps"] for k in ("std", "replicated")}
    per_rank["reference"] = {k: results[k]["reference"] for k in ("std", "replicated")}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(per_rank))
    if rank == 0:
        torch.save(results, out_dir / "results.pt")
    end_process_group()  # every rank together: a live gloo group at interpreter exit can abort the process


if __name__ == "__main__":
    freeze_import_heap()  # several trainings follow, each starting with a full gc.collect()
    main()
