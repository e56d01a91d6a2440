"""The TRL side of the comparison: TRL's ``DPOTrainer`` on the same workload as ``dpo.py`` (a peer, never a dependency).

TRL's side of every comparison, with the same flags, timing and ``RESULT`` fields: the random-init model of
``--model-size`` built by ``workload.build_model`` (ours' builder too; ``254m`` by default, the baseline's model;
``tiny`` with ``--tiny``), bf16 weights, ``bf16`` on CUDA, no gradient checkpointing unless asked, ``--bs`` pairs per
GPU per step, ``max_length`` 2048, seed 0; the pairs of
``workload.make_pairs`` (``(warmup + steps + 2) * bs * world`` of them) in TRL's pre-tokenised column layout; a
``TrainerCallback`` that synchronises CUDA at ``on_step_end`` only, step times = differences of consecutive step ends,
the first ``--warmup`` steps excluded; real tokens = the attention mask's ones (prompt + chosen and prompt + rejected
rows); MFU at ``8 x all parameters`` per token (TRL's formula) and at 8 x the parameters whose matmul runs per token
(``rows.param_counts``: a tied head counted once).

TRL options (each recorded in the row): ``--liger`` is ``DPOConfig(use_liger_kernel=True)``, TRL 1.16's strongest
setting (liger's RMSNorm / SwiGLU / RoPE kernels on the policy; TRL keeps its own fused log-prob head); without an
importable ``liger_kernel`` it prints why and exits with :data:`LIGER_MISSING`. ``--lora R`` passes
``peft_config=workload.lora_config(R)`` (the LoRA of ours' ``--lora R``; no reference copy: TRL disables the adapter
for the reference). ``--gradient-checkpointing`` is ``DPOConfig(gradient_checkpointing=True)`` (TRL's defaults).

TRL is optional: without it (``import trl`` fails) this prints how to install it and exits with status
:data:`TRL_MISSING`; the runner (``benchmarks/run.py``) skips TRL runs itself when ``trl`` is not importable.
Install for a comparison: ``pip install trl==1.16.0`` (it needs ``datasets``; the GPU machine gets both as carried
wheels, see docs/benchmarks_howto.md).

Examples:
    python -m benchmarks.trl_dpo --tag trl_sdpa --attn sdpa --no_cudnn_sdp
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 -m benchmarks.trl_dpo --tag trl_z3
    python -m benchmarks.trl_dpo --tiny                          # CPU smoke test
    python -m benchmarks.trl_dpo --tiny --model-size tiny-qwen --lora 4 --gradient-checkpointing
    python -m benchmarks.trl_dpo --tag trl_qwen_liger --model-size qwen1.5b --liger --no_cudnn_sdp
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from typing import Any

from benchmarks.clocks import clock_fields, sampled
from benchmarks.workload import MODEL_SIZES, build_model, lora_config, make_tokenizer, token_vocab, trl_rows

PROCESS_START = time.perf_counter()
TRL_MISSING = 3
"""Exit status when ``trl`` (or ``datasets``, which it needs) cannot be imported."""
INSTALL_HINT = (
    "the TRL side of the benchmark needs trl and datasets: pip install 'trl==1.16.0' datasets "
    "(a comparison peer only; pair_dpo_trainer never imports it)"
)
LIGER_MISSING = 4
"""Exit status of ``--liger`` when ``liger_kernel`` cannot be imported."""
TINY_SIZES = ("tiny", "tiny-qwen")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The former baseline's flags (underscores kept, so old command lines still parse) plus ``--model-size``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tag", default="run")
    p.add_argument("--attn", default="sdpa", help="attn_implementation of the model (sdpa, flex_attention, ...)")
    p.add_argument("--padding_free", action="store_true", help="DPOConfig(padding_free=True)")
    p.add_argument("--bs", type=int, default=8, help="pairs per GPU per optimizer step")
    p.add_argument("--steps", type=int, default=30, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed first steps")
    p.add_argument("--max_length", type=int, default=2048)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    p.add_argument("--results", default=os.path.join(os.environ.get("OUT", "/tmp"), "results.jsonl"))
    p.add_argument("--tiny", action="store_true", help="tiny model/CPU smoke test")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="254m", help="workload.MODEL_SIZES")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no_cudnn_sdp", action="store_true", help="torch.backends.cuda.enable_cudnn_sdp(False)")
    p.add_argument("--liger", action="store_true", help="DPOConfig(use_liger_kernel=True): liger's layer kernels")
    p.add_argument("--lora", type=int, metavar="R", help="peft_config=LoraConfig(r=R, alpha 2R, dropout 0) as ours")
    p.add_argument("--gradient-checkpointing", action="store_true", help="DPOConfig(gradient_checkpointing=True)")
    args = p.parse_args(argv)
    if args.tiny and args.model_size not in TINY_SIZES:
        args.model_size = "tiny"
    if args.lora is not None and args.lora < 1:
        p.error("--lora R needs a rank R >= 1")
    return args


def liger_problem() -> str | None:
    """Why ``--liger`` cannot run here (``liger_kernel.transformers`` does not import), or None."""
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception as exc:  # ImportError, or a triton / torch mismatch raised while importing
        return (
            f"--liger needs liger_kernel ({type(exc).__name__}: {exc}); pip install liger-kernel==0.8.5 (the GPU "
            "machine installs the carried wheel from .whl/ through benchmarks/device.sh; liger needs CUDA + triton)"
        )
    return None


def dpo_config_kwargs(args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    """``DPOConfig`` keyword arguments: the former baseline's Trainer settings plus the TRL options asked for."""
    kwargs: dict[str, Any] = dict(
        output_dir=f"/tmp/dpo_bench_{args.tag}", per_device_train_batch_size=args.bs,
        max_steps=args.warmup + args.steps, learning_rate=1e-6, bf16=cuda,
        gradient_checkpointing=args.gradient_checkpointing, logging_steps=10_000, save_strategy="no",
        report_to="none", max_length=args.max_length, padding_free=args.padding_free,
        dataloader_num_workers=args.workers, seed=args.seed, disable_tqdm=True, use_cpu=not cuda,
    )  # fmt: skip
    if args.liger:
        kwargs["use_liger_kernel"] = True
    return kwargs


def option_fields(args: argparse.Namespace, trainer: Any) -> dict[str, Any]:
    """Which TRL options ran: the flags, the versions, and (read from the trained policy) whether liger's modules
    replaced the model's and whether HF checkpointing was on it."""
    import importlib.metadata as metadata

    from benchmarks.rows import hf_checkpointing_on

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    model = trainer.accelerator.unwrap_model(trainer.model)
    liger_modules = sum(type(m).__name__.startswith("Liger") for m in model.modules())
    return {
        "trl_version": version("trl"),
        "trl_liger": args.liger,
        "liger_version": version("liger_kernel") if args.liger else None,
        "liger_modules": liger_modules,
        "lora_r": args.lora,
        "gradient_checkpointing": args.gradient_checkpointing,
        "hf_checkpointing_on_model": hf_checkpointing_on(model),
        "reference_backend": "adapter_disabled" if args.lora else "ref_model_copy",
    }


def trl_available() -> bool:
    """Whether ``trl`` and ``datasets`` can be imported here (checked without importing them)."""
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("trl", "datasets"))


def _bench_trainer_class(dpo_trainer: type) -> type:
    """``DPOTrainer`` that takes the pre-tokenised dataset as is and logs each micro-batch's attention mask."""

    class BenchDPOTrainer(dpo_trainer):  # type: ignore[misc, valid-type]
        tok_log: list[tuple[int, int, tuple[int, ...]]] = []

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset  # TRL 1.16 tokenises text columns here; the collator reads *_ids directly

        def training_step(self, *a, **kw):
            inputs = a[1] if len(a) > 1 else kw["inputs"]
            mask = inputs["attention_mask"]
            self.tok_log.append((int(mask.sum()), mask.numel(), tuple(mask.shape)))
            return super().training_step(*a, **kw)

    return BenchDPOTrainer


def result_row(args: argparse.Namespace, ctx: dict[str, Any], ends: list[float], log: list, trainer: Any) -> dict:
    """The ``RESULT`` row: the former baseline's fields, plus ``impl`` ``trl``, ``model_size``, the non-embedding MFU
    and the TRL options (:func:`option_fields`)."""
    import torch

    from benchmarks.rows import mfu_fields

    dts = [ends[i] - ends[i - 1] for i in range(args.warmup, len(ends))]  # steps warmup+1 .. total
    log = log[args.warmup : args.warmup + len(dts)]
    real, padded = sum(x[0] for x in log), sum(x[1] for x in log)
    med, tok_s, cuda = statistics.median(dts), real / sum(dts), ctx["cuda"]
    n_noembed = ctx.get("n_noembed", ctx["n_params"] - ctx["n_embed"])
    # 8N per token: policy fwd+bwd (6N) + reference fwd (2N), attention flops excluded
    mfu = mfu_fields(tok_s, ctx["n_params"], n_noembed, 8)
    options = option_fields(args, trainer) if hasattr(trainer, "accelerator") else {}
    return dict(
        tag=args.tag, impl="trl", model_size=args.model_size, rank=ctx["rank"], world=ctx["world"], attn=args.attn,
        padding_free_requested=args.padding_free, padding_free_effective=getattr(trainer, "padding_free", None),
        deepspeed=bool(trainer.is_deepspeed_enabled), bs_pairs=args.bs, steps_timed=len(dts),
        step_median_s=round(med, 4), step_mean_s=round(sum(dts) / len(dts), 4), step_min_s=round(min(dts), 4),
        step_max_s=round(max(dts), 4), real_tokens_per_step=round(real / len(log), 1),
        padded_tokens_per_step=round(padded / len(log), 1), padding_frac=round(1 - real / padded, 4),
        real_tok_s_gpu=round(tok_s, 1), real_tok_s_gpu_from_median=round(real / len(log) / med, 1),
        **mfu, n_params=ctx["n_params"], n_params_no_embed=n_noembed,
        n_params_trainable=ctx.get("n_trainable"), **options,
        peak_alloc_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        peak_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda else None,
        train_wall_s=round(ctx["train_wall_s"], 1), setup_wall_s=round(ctx.get("setup_wall_s", 0.0), 1),
        shapes_first=[x[2] for x in log[:3]],
        no_cudnn_sdp=args.no_cudnn_sdp, step_s=[round(d, 3) for d in dts], seq_len=[x[2][1] for x in log],
        warmup_step_s=[round(ends[i] - ends[i - 1], 3) for i in range(1, args.warmup)],
    )  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Builds the model, the data and TRL's trainer, trains, and returns the ``RESULT`` row."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from benchmarks.rows import param_counts

    ctx: dict[str, Any] = {"rank": int(os.environ.get("RANK", "0")), "world": int(os.environ.get("WORLD_SIZE", "1"))}
    local_rank, ctx["cuda"] = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.is_available()
    if ctx["cuda"]:
        torch.cuda.set_device(local_rank)
        if args.no_cudnn_sdp:
            torch.backends.cuda.enable_cudnn_sdp(False)
    ends: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            if ctx["cuda"]:
                torch.cuda.synchronize()
            ends.append(time.perf_counter())

    device = f"cuda:{local_rank}" if ctx["cuda"] else "cpu"
    model = build_model(args.model_size, seed=args.seed, device=device, dtype=torch.bfloat16, attn=args.attn)
    ref_model = None if args.lora else copy.deepcopy(model).eval()  # LoRA: TRL disables the adapter instead
    ctx["n_params"], ctx["n_noembed"] = param_counts(model)  # the base model's (as ours)
    ctx["n_embed"] = ctx["n_params"] - ctx["n_noembed"]
    total_steps = args.warmup + args.steps
    rows = trl_rows((total_steps + 2) * args.bs * ctx["world"], args.seed, token_vocab(args.model_size))
    dataset = Dataset.from_dict(rows)
    dpo_config = DPOConfig(**dpo_config_kwargs(args, ctx["cuda"]))
    trainer_class = _bench_trainer_class(DPOTrainer)
    trainer = trainer_class(
        model=model,
        ref_model=ref_model,
        args=dpo_config,
        train_dataset=dataset,
        processing_class=make_tokenizer(),
        callbacks=[StepTimer()],
        peft_config=lora_config(args.lora) if args.lora else None,
    )
    ctx["n_trainable"] = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    if ctx["cuda"]:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    ctx["setup_wall_s"] = start - PROCESS_START
    with sampled(ctx["cuda"]) as sampler:
        trainer.train()
    ctx["train_wall_s"] = time.perf_counter() - start
    row = result_row(args, ctx, ends, trainer_class.tok_log, trainer)
    return {**row, **clock_fields(sampler, ends, args.warmup, row["mfu8N_989"])}


def main(argv: list[str] | None = None) -> int:
    """Runs the TRL baseline; prints ``RESULT {json}`` and appends it to ``--results``. Exit status 0, or
    :data:`TRL_MISSING` with the install hint when trl is absent."""
    args = parse_args(argv)
    if not trl_available():
        print(f"SKIPPED {args.tag}: {INSTALL_HINT}", flush=True)
        return TRL_MISSING
    if args.liger and (problem := liger_problem()):
        print(f"LIGER_MISSING {args.tag}: {problem}", flush=True)
        return LIGER_MISSING
    row = run(args)
    line = json.dumps(row)
    print("RESULT " + line, flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
    with open(args.results, "a") as handle:
        handle.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
