"""The CUDA allocator as a library user meets it: ``PairDPOTrainer`` in a plain script (no ``train.py``, no benchmark
subclass or callback), on a long-tailed workload, with the allocated and reserved peaks of the run.

The script sets no allocator variable itself: run it with ``PYTORCH_CUDA_ALLOC_CONF`` (and ``PYTORCH_ALLOC_CONF``)
unset to see what the library does on its own. The row records the variables at start and after training,
``expandable_segments`` (how many of the caching allocator's segments are expandable at the end, from
``torch.cuda.memory_snapshot()``), the allocator's retries (``num_alloc_retries``: cache flushes to satisfy a
request, the cost of fragmentation) and ``reserved_over_alloc`` = peak reserved / peak allocated against the target
(``--target``, 1.15). It prints ``RESULT {json}`` and ``RATIO reserved/allocated = ...`` and appends the row to
``$OUT/results.jsonl`` (or ``--results``).

Workload (``benchmarks.workload``): the random-init ``--model-size`` model (bf16 on CUDA), ``--pairs`` pairs per
optimizer step of the ``--mix`` (``heavy``: prompts and completions to 4096 tokens, ``max_length`` 8192), one packed
micro-batch per step unless ``--max-tokens-per-microbatch``; the trainer builds its own reference (a copy of the
in-memory policy).

Examples:
    python -m benchmarks.alloc_check --tag alloc_lib                     # 1.5B, heavy mix, 4 pairs per step
    python -m benchmarks.alloc_check --tiny --steps 2                    # CPU smoke test (no CUDA peaks)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from typing import Any

ALLOC_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
ENV_AT_START = {name: os.environ.get(name) for name in ALLOC_VARS}
"""The allocator variables when this module was imported: before torch or pair_dpo_trainer (imported lazily below)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from benchmarks.workload import MODEL_SIZES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tag", default="alloc_check")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="1.5b")
    p.add_argument("--tiny", action="store_true", help="the tiny model in float32, CPU allowed")
    p.add_argument("--pairs", type=int, default=4, help="pairs per optimizer step")
    p.add_argument("--mix", choices=("trl", "heavy"), default="heavy")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps")
    p.add_argument("--max-tokens-per-microbatch", type=int, help="PairDPOConfig.max_tokens_per_microbatch")
    p.add_argument("--target", type=float, default=1.15, help="reserved / allocated peak to stay under")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", help="JSONL file to append to (default: $OUT/results.jsonl when OUT is set)")
    args = p.parse_args(argv)
    if args.tiny and not args.model_size.startswith("tiny"):
        args.model_size = "tiny"
    if args.results is None and os.environ.get("OUT"):
        args.results = os.path.join(os.environ["OUT"], "results.jsonl")
    return args


def allocator_state(torch: Any) -> dict[str, Any]:
    """The allocator's variables now, its settings string (torch versions that can report it) and the expandable
    segments of the CUDA cache (None on the CPU)."""
    state: dict[str, Any] = {name: os.environ.get(name) for name in ALLOC_VARS}
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    state["settings"] = getter() if getter is not None and torch.cuda.is_available() else None
    if torch.cuda.is_available():
        segments = torch.cuda.memory_snapshot()
        state["segments"] = len(segments)
        state["expandable_segments"] = sum(bool(s.get("is_expandable")) for s in segments)
    return state


def build(args: argparse.Namespace) -> Any:
    """Model, pairs, config and trainer, as a user's script would write them."""
    import torch

    from benchmarks.workload import build_model, make_pairs, make_tokenizer, token_vocab
    from pair_dpo_trainer.config import PairDPOConfig
    from pair_dpo_trainer.trainer import PairDPOTrainer

    cuda = torch.cuda.is_available()
    bf16 = cuda and not args.tiny
    device = "cuda" if cuda else "cpu"
    model = build_model(args.model_size, seed=args.seed, device=device, dtype=torch.bfloat16 if bf16 else None)
    pairs = make_pairs((args.steps + 2) * args.pairs, args.seed, args.mix, token_vocab(args.model_size))
    kwargs: dict[str, Any] = dict(
        output_dir=os.path.join(tempfile.gettempdir(), f"pair_dpo_alloc_{args.tag}"),
        per_device_train_batch_size=args.pairs,
        max_steps=args.steps,
        learning_rate=1e-6,
        bf16=bf16,
        logging_steps=10_000,
        save_strategy="no",
        report_to="none",
        max_length=8192 if args.mix == "heavy" else 2048,
        max_prompt_length=4096 if args.mix == "heavy" else 512,
        dataloader_num_workers=0,
        seed=args.seed,
        disable_tqdm=True,
        use_cpu=not cuda,
        max_tokens_per_microbatch=args.max_tokens_per_microbatch,
    )
    if "allow_unpinned_reference" in {f.name for f in dataclasses.fields(PairDPOConfig)}:
        kwargs["allow_unpinned_reference"] = True  # the in-memory random-init policy has no pinned snapshot
    return PairDPOTrainer(
        model=model, args=PairDPOConfig(**kwargs), train_dataset=pairs, processing_class=make_tokenizer()
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Trains ``--steps`` steps through the library API and returns (prints, appends) the memory row."""
    args = parse_args(argv)
    at_start = dict(ENV_AT_START)
    import torch

    from benchmarks.report import emit

    trainer = build(args)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    alloc = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    reserved = torch.cuda.max_memory_reserved() / 2**30 if cuda else None
    stats = torch.cuda.memory_stats() if cuda else {}
    ratio = reserved / alloc if alloc else None
    row = {
        "tag": args.tag,
        "impl": "alloc_check",
        "rank": 0,
        "world": 1,
        "model_size": args.model_size,
        "mix": args.mix,
        "bs_pairs": args.pairs,
        "steps": args.steps,
        "max_tokens_per_microbatch": args.max_tokens_per_microbatch,
        "alloc_env_at_start": at_start,
        "allocator_after_train": allocator_state(torch),
        "peak_alloc_gib": round(alloc, 2) if alloc is not None else None,
        "peak_reserved_gib": round(reserved, 2) if reserved is not None else None,
        "reserved_over_alloc": round(ratio, 4) if ratio is not None else None,
        "target": args.target,
        "target_met": ratio <= args.target if ratio is not None else None,
        "num_alloc_retries": stats.get("num_alloc_retries"),
        "num_ooms": stats.get("num_ooms"),
        "train_wall_s": round(wall, 1),
        "attn": f"pair_varlen:{trainer.attn_backend}",
    }
    emit("RESULT", row, args.results)
    if ratio is not None:
        print(
            f"RATIO reserved/allocated = {ratio:.3f} ({args.tag}: {reserved:.2f} / {alloc:.2f} GiB, target <= "
            f"{args.target}: {'met' if ratio <= args.target else 'NOT met'}; env at start {at_start})",
            flush=True,
        )
    return row


if __name__ == "__main__":
    main()
