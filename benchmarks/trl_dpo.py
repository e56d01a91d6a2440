"""The TRL side of the comparison: TRL's ``DPOTrainer`` on the same workload as ``dpo.py`` (a peer, never a dependency).

TRL's side of every comparison, with the same flags, timing and ``RESULT`` fields: a random-init Llama of
``--model-size`` (``254m`` by default, the baseline's model; ``tiny`` with ``--tiny``), bf16 weights, ``bf16`` on CUDA,
no gradient checkpointing, ``--bs`` pairs per GPU per step, ``max_length`` 2048, seed 0; the pairs of
``workload.make_pairs`` (``(warmup + steps + 2) * bs * world`` of them) in TRL's pre-tokenised column layout; a
``TrainerCallback`` that synchronises CUDA at ``on_step_end`` only, step times = differences of consecutive step ends,
the first ``--warmup`` steps excluded; real tokens = the attention mask's ones (prompt + chosen and prompt + rejected
rows); MFU at ``8 x all parameters`` per token (TRL's formula).

TRL is optional: without it (``import trl`` fails) this prints how to install it and exits with status
:data:`TRL_MISSING`; the runner (``benchmarks/run.py``) skips TRL runs itself when ``trl`` is not importable.
Install for a comparison: ``pip install trl==1.16.0`` (it needs ``datasets``; the GPU machine gets both as carried
wheels, see docs/benchmarks_howto.md).

Examples:
    python -m benchmarks.trl_dpo --tag trl_sdpa --attn sdpa --no_cudnn_sdp
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 -m benchmarks.trl_dpo --tag trl_z3
    python -m benchmarks.trl_dpo --tiny                          # CPU smoke test
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

from benchmarks.workload import MODEL_SIZES, make_tokenizer, model_dims, trl_rows

TRL_MISSING = 3
"""Exit status when ``trl`` (or ``datasets``, which it needs) cannot be imported."""
INSTALL_HINT = (
    "the TRL side of the benchmark needs trl and datasets: pip install 'trl==1.16.0' datasets "
    "(a comparison peer only; pair_dpo_trainer never imports it)"
)


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
    args = p.parse_args(argv)
    if args.tiny:
        args.model_size = "tiny"
    return args


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
    """The ``RESULT`` row: the former baseline's fields, plus ``impl`` ``trl`` and ``model_size``."""
    import torch

    dts = [ends[i] - ends[i - 1] for i in range(args.warmup, len(ends))]  # steps warmup+1 .. total
    log = log[args.warmup : args.warmup + len(dts)]
    real, padded = sum(x[0] for x in log), sum(x[1] for x in log)
    med, tok_s, cuda = statistics.median(dts), real / sum(dts), ctx["cuda"]
    flops_tok = 8 * ctx["n_params"]  # policy fwd+bwd (6N) + reference fwd (2N), attention flops excluded
    return dict(
        tag=args.tag, impl="trl", model_size=args.model_size, rank=ctx["rank"], world=ctx["world"], attn=args.attn,
        padding_free_requested=args.padding_free, padding_free_effective=getattr(trainer, "padding_free", None),
        deepspeed=bool(trainer.is_deepspeed_enabled), bs_pairs=args.bs, steps_timed=len(dts),
        step_median_s=round(med, 4), step_mean_s=round(sum(dts) / len(dts), 4), step_min_s=round(min(dts), 4),
        step_max_s=round(max(dts), 4), real_tokens_per_step=round(real / len(log), 1),
        padded_tokens_per_step=round(padded / len(log), 1), padding_frac=round(1 - real / padded, 4),
        real_tok_s_gpu=round(tok_s, 1), real_tok_s_gpu_from_median=round(real / len(log) / med, 1),
        mfu8N_989=round(flops_tok * tok_s / 989e12, 4), mfu8N_790=round(flops_tok * tok_s / 790e12, 4),
        n_params=ctx["n_params"], n_params_no_embed=ctx["n_params"] - ctx["n_embed"],
        peak_alloc_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        peak_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda else None,
        train_wall_s=round(ctx["train_wall_s"], 1), shapes_first=[x[2] for x in log[:3]],
        no_cudnn_sdp=args.no_cudnn_sdp, step_s=[round(d, 3) for d in dts], seq_len=[x[2][1] for x in log],
        warmup_step_s=[round(ends[i] - ends[i - 1], 3) for i in range(1, args.warmup)],
    )  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Builds the model, the data and TRL's trainer, trains, and returns the ``RESULT`` row."""
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback
    from trl import DPOConfig, DPOTrainer

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

    config = LlamaConfig(**model_dims(args.model_size))
    config._attn_implementation = args.attn
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    if ctx["cuda"]:
        model = model.to(f"cuda:{local_rank}")
    ref_model = copy.deepcopy(model).eval()
    ctx["n_params"] = sum(p.numel() for p in model.parameters())
    ctx["n_embed"] = model.model.embed_tokens.weight.numel()
    total_steps = args.warmup + args.steps
    dataset = Dataset.from_dict(trl_rows((total_steps + 2) * args.bs * ctx["world"], args.seed))
    dpo_config = DPOConfig(
        output_dir=f"/tmp/dpo_bench_{args.tag}", per_device_train_batch_size=args.bs, max_steps=total_steps,
        learning_rate=1e-6, bf16=ctx["cuda"], gradient_checkpointing=False, logging_steps=10_000,
        save_strategy="no", report_to="none", max_length=args.max_length, padding_free=args.padding_free,
        dataloader_num_workers=args.workers, seed=args.seed, disable_tqdm=True, use_cpu=not ctx["cuda"],
    )  # fmt: skip
    trainer_class = _bench_trainer_class(DPOTrainer)
    trainer = trainer_class(
        model=model,
        ref_model=ref_model,
        args=dpo_config,
        train_dataset=dataset,
        processing_class=make_tokenizer(),
        callbacks=[StepTimer()],
    )
    if ctx["cuda"]:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train()
    ctx["train_wall_s"] = time.perf_counter() - start
    return result_row(args, ctx, ends, trainer_class.tok_log, trainer)


def main(argv: list[str] | None = None) -> int:
    """Runs the TRL baseline; prints ``RESULT {json}`` and appends it to ``--results``. Exit status 0, or
    :data:`TRL_MISSING` with the install hint when trl is absent."""
    args = parse_args(argv)
    if not trl_available():
        print(f"SKIPPED {args.tag}: {INSTALL_HINT}", flush=True)
        return TRL_MISSING
    row = run(args)
    line = json.dumps(row)
    print("RESULT " + line, flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
    with open(args.results, "a") as handle:
        handle.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
