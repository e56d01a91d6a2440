"""The longest preference pair one GPU trains: ours per memory strategy, and TRL's DPOTrainer (+ liger) with gradient
checkpointing, on the random-init models of ``workload.MODEL_SIZES`` (``qwen1.5b``, ``8b``, ...).

A pair of ``T`` tokens is a prompt of about ``prompt_frac * T`` tokens (0.9 by default) and two completions of equal
length sharing the rest (each ending with EOS; ids drawn with the seed). ``T = P + C + R`` is what our
shared-prompt row holds; TRL computes ``2P + C + R`` (two rows of ``P + C``), reported beside it. One try = one
optimizer step on that single pair in a FRESH subprocess (a CUDA out-of-memory error can leave a process unusable):
it succeeds, or fails with out-of-memory (``oom``), a timeout or a killed process (host memory: ``killed``); any other
error stops the search (a bug must not pass for a limit). A try's ``train_s`` is the Trainer's ``train_runtime`` of
that one step (model building excluded; the first step of a process, so warm-up included). Before that step the
optimizer's state is made resident (:func:`resident_optimizer_state`: AdamW's two moments per parameter, ~4 bytes per
parameter in bf16, 30 GiB at 8B), so the try's peak is that of every later step of a run, not the lighter first one,
whose backward runs before the moments exist. The search doubles ``T``
from ``--start`` until a try fails (halving instead when the first one fails), then bisects until the largest success
and the smallest failure are within ``--resolution`` (5%) of each other; ``--time-limit`` stops it early
with the bracket it has.

Ours (``--side ours``): ``--strategy`` names the memory settings of ``PairDPOConfig``: a checkpointing mode (``off``,
``selective``, ``layers:K``, ``full``) with ``+offload`` (``activation_offload``) and ``+tiled`` (``tiled_mlp='auto'``),
or ``auto`` (``activation_checkpointing_mode='auto'`` at a budget of exactly the pair's ``T``, which may itself add
offload and tiles). The pair is packed in the shared-prompt layout (``share_prompt=True``), the LM head is the chunked
one (``--logps-chunk-size``), the reference an in-memory bf16 copy. TRL (``--side trl``): ``--strategy gc`` is
``DPOConfig(gradient_checkpointing=True)``, ``liger+gc`` adds ``use_liger_kernel=True``; sdpa attention
(``--no-cudnn-sdp``), ``max_length = P + C`` (nothing truncated).

``--max-tokens-cap N`` stands in for the GPU in CPU smoke tests: a try of more than ``N`` tokens fails as ``oom``
without running (the subprocess still starts), the others run for real on the tiny model.

Every try and the result are JSON rows (``TRY``/``LONGEST`` lines, appended to ``--results`` or ``$OUT/results.jsonl``);
``--summarize FILE`` prints the markdown table of the ``LONGEST`` rows (docs/benchmarks.md, "Long pairs").

Examples:
    python -m benchmarks.longest_pair --side ours --model-size qwen1.5b --strategy full+offload+tiled --start 65536
    python -m benchmarks.longest_pair --side trl --model-size qwen1.5b --strategy liger+gc --no-cudnn-sdp
    python -m benchmarks.longest_pair --tiny --max-tokens-cap 600 --start 128 --resolution 0.5   # CPU smoke test
    python -m benchmarks.longest_pair --summarize $OUT/results.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

FAILURES = ("oom", "timeout", "killed")
"""Try outcomes that mean "does not fit"; any other non-``ok`` outcome stops the search."""
TRL_STRATEGIES = ("gc", "liger+gc")


# --------------------------------------------------------------------------------------------------- the search
@dataclass
class Search:
    """The search's state and result: the largest ``T`` that trained, the smallest that failed, every try."""

    longest: int = 0
    first_failure: int | None = None
    tries: list[dict[str, Any]] = field(default_factory=list)
    stopped: str | None = None  # why the search ended before its resolution ("time limit", "error ...")


def resolved(search: Search, resolution: float) -> bool:
    """The bracket is within ``resolution`` of the longest success (False while nothing has both fit and failed).

    Example:
        >>> resolved(Search(longest=1000, first_failure=1040), 0.05), resolved(Search(longest=1000), 0.05)
        (True, False)
    """
    if search.first_failure is None or search.longest == 0:
        return False
    return (search.first_failure - search.longest) <= resolution * search.longest


def next_length(search: Search, start: int, multiple: int, minimum: int) -> int | None:
    """The next ``T`` to try: ``start``; doubling while all succeed; halving while all fail; then the midpoint,
    rounded to ``multiple`` (None when the bracket cannot be split further or nothing down to ``minimum`` fits).

    Example:
        >>> next_length(Search(longest=4096), 1024, 64, 64), next_length(Search(first_failure=1024), 1024, 64, 64)
        (8192, 512)
        >>> next_length(Search(longest=4096, first_failure=8192), 1024, 64, 64)
        6144
    """
    if search.longest == 0 and search.first_failure is None:
        return start
    if search.first_failure is None:
        return 2 * search.longest
    if search.longest == 0:
        half = search.first_failure // 2 // multiple * multiple
        return half if half >= minimum else None
    mid = (search.longest + search.first_failure) // 2 // multiple * multiple
    return mid if search.longest < mid < search.first_failure else None


def find_longest(
    attempt: Callable[[int], dict[str, Any]],
    *,
    start: int,
    resolution: float = 0.05,
    multiple: int = 64,
    minimum: int = 64,
    max_tries: int = 24,
    time_limit: float | None = None,
) -> Search:
    """Doubling, then bisection, over ``attempt(T)`` (a row whose ``status`` is ``ok`` or one of :data:`FAILURES`)."""
    search, began = Search(), time.monotonic()
    while not resolved(search, resolution) and len(search.tries) < max_tries:
        if time_limit is not None and time.monotonic() - began > time_limit:
            search.stopped = "time limit"
            break
        tokens = next_length(search, start, multiple, minimum)
        if tokens is None:  # the bracket is one multiple wide, or nothing fits down to the minimum
            search.stopped = None if search.longest else f"nothing fits down to {minimum} tokens"
            break
        row = attempt(tokens)
        search.tries.append(row)
        if row["status"] == "ok":
            search.longest = max(search.longest, tokens)
        elif row["status"] in FAILURES:
            search.first_failure = min(tokens, search.first_failure or tokens)
        else:
            search.stopped = f"{row['status']} at {tokens} tokens: {row.get('error', '')}"
            break
    return search


# --------------------------------------------------------------------------------------------------- one try
def pair_lengths(tokens: int, prompt_frac: float) -> tuple[int, int, int]:
    """``(P, C, R)`` of a ``tokens``-token pair: two completions of equal length ``C = R`` (at least 2 tokens each:
    TRL's two rows then need no padding, so its attention needs no mask) sharing ``tokens - P``, with ``P`` within
    one token of ``prompt_frac * tokens``.

    Example:
        >>> pair_lengths(1000, 0.9), pair_lengths(128, 0.9), pair_lengths(10, 0.9)
        ((900, 50, 50), (116, 6, 6), (6, 2, 2))
    """
    completion = max(2, (tokens - round(prompt_frac * tokens)) // 2)
    return tokens - 2 * completion, completion, completion


def child_command(args: argparse.Namespace, tokens: int) -> list[str]:
    """The subprocess that runs one try of ``tokens`` tokens (this module with ``--child``)."""
    command = [sys.executable, "-m", "benchmarks.longest_pair", "--child", "--tokens", str(tokens)]
    for flag in ("side", "model_size", "strategy", "prompt_frac", "seed", "logps_chunk_size", "max_tokens_cap"):
        value = getattr(args, flag)
        if value is not None:
            command += [f"--{flag.replace('_', '-')}", str(value)]
    command += [flag for flag in ("--tiny", "--no-cudnn-sdp", "--compile") if getattr(args, flag[2:].replace("-", "_"))]
    return command


def attempt_in_subprocess(args: argparse.Namespace, tokens: int) -> dict[str, Any]:
    """Runs one try in a fresh process; its ``TRY`` row, or a row saying how the process ended without one. A try
    that would outlast ``--time-limit`` gets the time left (at least 30 s); stopped by it, it ends as ``deadline``
    (which ends the search), not as a failure."""
    began = time.monotonic()
    base = {"side": args.side, "strategy": args.strategy, "model_size": args.model_size, "tokens": tokens}
    limit, cut = args.try_timeout, False
    if args.deadline is not None and args.deadline - began < limit:
        limit, cut = max(args.deadline - began, 30.0), True
    try:
        done = subprocess.run(child_command(args, tokens), capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return {**base, "status": "deadline" if cut else "timeout", "wall_s": round(time.monotonic() - began, 1)}
    rows = [json.loads(line[4:]) for line in done.stdout.splitlines() if line.startswith("TRY ")]
    if rows:
        return rows[-1]
    status = "killed" if done.returncode in (-9, 137) else "error"
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return {**base, "status": status, "returncode": done.returncode, "error": " | ".join(tail)}


def is_out_of_memory(exc: BaseException) -> bool:
    """A CUDA (or host allocator) out-of-memory error, by type or message."""
    text = str(exc).lower()
    return type(exc).__name__ == "OutOfMemoryError" or "out of memory" in text or "can't allocate memory" in text


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    """One try in this process: the pair of ``--tokens`` tokens, one optimizer step; the ``TRY`` row."""
    prompt, chosen, rejected = pair_lengths(args.tokens, args.prompt_frac)
    row: dict[str, Any] = {"side": args.side, "strategy": args.strategy, "model_size": args.model_size}
    row.update(tokens=args.tokens, prompt=prompt, chosen=chosen, rejected=rejected, trl_tokens=args.tokens + prompt)
    if args.max_tokens_cap is not None and args.tokens > args.max_tokens_cap:
        return {**row, "status": "oom", "simulated": True}
    began = time.monotonic()
    try:
        import torch

        (train_ours if args.side == "ours" else train_trl)(args, (prompt, chosen, rejected), row)
        row["status"] = "ok"
        if torch.cuda.is_available():
            row["peak_alloc_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            row["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    except Exception as exc:  # the outcome is the row: out-of-memory is a result, anything else an error
        row["status"] = "oom" if is_out_of_memory(exc) else "error"
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    row["wall_s"] = round(time.monotonic() - began, 1)
    return row


# --------------------------------------------------------------------------------------------------- the two sides
def resident_optimizer_state(row: dict[str, Any]) -> Any:
    """A ``TrainerCallback`` that makes the optimizer's lazily created state resident when training begins
    (:func:`materialize_optimizer_state`) and writes its size to ``row["optimizer_state_gib"]``.

    Why: ``torch.optim.AdamW`` allocates its two moments in its first ``step()``, after the first backward, so a
    run's first step peaks lower than every later one by the moments' size (4 bytes per bf16 parameter: 30 GiB at
    8B). With them resident, a one-step try peaks as the later steps of a run do.
    """
    from transformers import TrainerCallback

    class ResidentOptimizerState(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
            if optimizer is None:
                raise RuntimeError("the Trainer passed no optimizer to on_train_begin: the try would miss its state")
            row["optimizer_state_gib"] = round(materialize_optimizer_state(optimizer) / 2**30, 2)

    return ResidentOptimizerState()


def materialize_optimizer_state(optimizer: Any) -> int:
    """One step of ``optimizer`` (a ``torch.optim.Optimizer`` or Accelerate's wrapper of one) at learning rate 0 over
    zero gradients, then the learning rates restored: AdamW's moments become resident zeros, the parameters stay bit
    for bit (weight decay scales by ``1 - 0 * wd``) and hold no gradient afterwards. Returns the state's bytes."""
    import torch

    inner = getattr(optimizer, "optimizer", optimizer)
    rates = [group["lr"] for group in inner.param_groups]
    params = [p for group in inner.param_groups for p in group["params"] if p.requires_grad]
    for group in inner.param_groups:
        group["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    inner.step()
    for group, rate in zip(inner.param_groups, rates, strict=True):
        group["lr"] = rate
    for p in params:
        p.grad = None
    return sum(v.numel() * v.element_size() for st in inner.state.values() for v in st.values() if torch.is_tensor(v))


def the_pair(lengths: tuple[int, int, int], seed: int, vocab: int) -> dict[str, list[int]]:
    """The pair's token ids (``workload``'s draw: ids in [3, vocab), completions ending with EOS)."""
    import numpy as np

    from benchmarks.workload import _pair_ids

    return _pair_ids(np.random.default_rng(seed), *lengths, vocab)


def ours_strategy(strategy: str) -> dict[str, Any]:
    """``PairDPOConfig`` keyword arguments of an ours ``--strategy``.

    Example:
        >>> ours_strategy("full+offload+tiled")
        {'activation_checkpointing_mode': 'full', 'activation_offload': True, 'tiled_mlp': 'auto'}
    """
    mode, *extras = strategy.split("+")
    unknown = set(extras) - {"offload", "tiled"}
    if unknown or not re.fullmatch(r"off|full|selective|auto|layers:[2-9]\d*", mode):
        raise SystemExit(f"--strategy {strategy!r}: MODE[+offload][+tiled] with MODE off|selective|layers:K|full|auto")
    kwargs: dict[str, Any] = {"activation_checkpointing_mode": mode}
    if "offload" in extras:
        kwargs["activation_offload"] = True
    if "tiled" in extras:
        kwargs["tiled_mlp"] = "auto"
    return kwargs


def _model(args: argparse.Namespace, attn: str | None = None) -> tuple[Any, Any, bool]:
    import torch

    from benchmarks.workload import build_model

    cuda = torch.cuda.is_available()
    if cuda and args.no_cudnn_sdp:
        torch.backends.cuda.enable_cudnn_sdp(False)
    device = torch.device("cuda:0" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda and not args.tiny else None
    return build_model(args.model_size, seed=args.seed, device=device, dtype=dtype, attn=attn), device, cuda


def train_ours(args: argparse.Namespace, lengths: tuple[int, int, int], row: dict[str, Any]) -> None:
    """One optimizer step of ``PairDPOTrainer`` on the pair (shared-prompt layout, budget = its tokens)."""
    import copy
    import tempfile

    from benchmarks.workload import make_tokenizer, token_vocab
    from pair_dpo_trainer import PairDPOConfig, PairDPOTrainer

    model, _device, cuda = _model(args)
    prompt, chosen, rejected = lengths
    config = PairDPOConfig(
        output_dir=os.path.join(tempfile.gettempdir(), "pair_dpo_longest_pair"),
        per_device_train_batch_size=1, gradient_accumulation_steps=1, max_steps=1, learning_rate=1e-6,
        bf16=cuda and not args.tiny, logging_steps=10_000, save_strategy="no", report_to="none",
        max_length=prompt + max(chosen, rejected), max_prompt_length=prompt, max_tokens_per_microbatch=sum(lengths),
        dataloader_num_workers=0, disable_tqdm=True, use_cpu=not cuda, allow_unpinned_reference=True,
        share_prompt=True, logps_chunk_size=args.logps_chunk_size, torch_compile=args.compile,
        **ours_strategy(args.strategy),
    )  # fmt: skip
    trainer = PairDPOTrainer(
        model=model,
        args=config,
        train_dataset=[the_pair(lengths, args.seed, token_vocab(args.model_size))],
        processing_class=make_tokenizer(),
        ref_model=copy.deepcopy(model),
    )
    trainer.add_callback(resident_optimizer_state(row))
    row["train_s"] = round(trainer.train().metrics["train_runtime"], 2)
    plan = trainer.layer_plan
    row["layers"] = None if plan is None else plan.describe().strip(" |")


def train_trl(args: argparse.Namespace, lengths: tuple[int, int, int], row: dict[str, Any]) -> None:
    """One optimizer step of TRL's ``DPOTrainer`` on the pair (``benchmarks.trl_dpo``'s trainer and settings)."""
    import copy

    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from benchmarks.trl_dpo import _bench_trainer_class, dpo_config_kwargs
    from benchmarks.trl_dpo import parse_args as trl_parse_args
    from benchmarks.workload import make_tokenizer, token_vocab

    if args.strategy not in TRL_STRATEGIES:
        raise SystemExit(f"--side trl --strategy {args.strategy!r}: use one of {list(TRL_STRATEGIES)}")
    prompt, chosen, rejected = lengths
    flags = ["--tag", "longest_pair", "--bs", "1", "--steps", "1", "--warmup", "0", "--workers", "0"]
    flags += [
        "--max_length",
        str(prompt + max(chosen, rejected)),
        "--model-size",
        args.model_size,
        "--gradient-checkpointing",
    ]
    trl_args = trl_parse_args(flags + (["--liger"] if args.strategy == "liger+gc" else []))
    model, _device, cuda = _model(args, attn=trl_args.attn)
    pair = the_pair(lengths, args.seed, token_vocab(args.model_size))
    columns = {f"{key}_ids": [pair[f"{key}_input_ids"]] for key in ("prompt", "chosen", "rejected")}
    trainer = _bench_trainer_class(DPOTrainer)(
        model=model,
        ref_model=copy.deepcopy(model).eval(),
        args=DPOConfig(**dpo_config_kwargs(trl_args, cuda)),
        train_dataset=Dataset.from_dict(columns),
        processing_class=make_tokenizer(),
    )
    trainer.add_callback(resident_optimizer_state(row))
    row["train_s"] = round(trainer.train().metrics["train_runtime"], 2)
    row["trl_rows_shape"] = list(trainer.tok_log[-1][2]) if trainer.tok_log else None


# --------------------------------------------------------------------------------------------------- rows and table
def longest_row(args: argparse.Namespace, search: Search, wall_s: float) -> dict[str, Any]:
    """The ``LONGEST`` row: the longest pair that trained (``T``, as TRL counts it, its longest sequence), the
    smallest that failed, the peak memory at the longest, every try's length and outcome."""
    prompt, chosen, rejected = pair_lengths(search.longest, args.prompt_frac) if search.longest else (0, 0, 0)
    at_longest = next((t for t in search.tries if t["status"] == "ok" and t["tokens"] == search.longest), {})
    return {
        "kind": "longest",
        "tag": args.tag,
        "side": args.side,
        "strategy": args.strategy,
        "model_size": args.model_size,
        "prompt_frac": args.prompt_frac,
        "longest_tokens": search.longest,
        "longest_trl_tokens": search.longest + prompt,
        "longest_sequence": prompt + max(chosen, rejected),
        "first_failure_tokens": search.first_failure,
        "resolution": args.resolution,
        "resolved": resolved(search, args.resolution),
        "stopped": search.stopped,
        "peak_alloc_gib": at_longest.get("peak_alloc_gib"),
        "layers": at_longest.get("layers"),
        "tries": [[t["tokens"], t["status"]] for t in search.tries],
        "search_wall_s": round(wall_s, 1),
        "device": device_name(),
    }


def device_name() -> str | None:
    """The GPU's name from ``nvidia-smi`` (no CUDA initialised in the searching process), or None."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        )
    except OSError:
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def summary_table(path: str) -> str:
    """Markdown table of the ``LONGEST`` rows of a JSONL file, longest first per model size."""
    rows = []
    with open(path, encoding="utf-8") as handle:
        rows = [row for row in map(json.loads, handle) if row.get("kind") == "longest"]
    rows.sort(key=lambda r: (r["model_size"], -r["longest_tokens"]))
    lines = [
        "| model | side | strategy | longest pair P+C+R | as TRL computes it 2P+C+R | longest sequence P+C | "
        "first failure | peak GiB | device |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        side = "ours" if r["side"] == "ours" else "TRL"
        exact = "" if r["resolved"] else f" ({r['stopped'] or 'unresolved'})"
        lines.append(
            f"| {r['model_size']} | {side} | `{r['strategy']}` | {r['longest_tokens']:,}{exact} | "
            f"{r['longest_trl_tokens']:,} | {r['longest_sequence']:,} | {r['first_failure_tokens'] or '-'} | "
            f"{r['peak_alloc_gib'] or '-'} | {r['device'] or '-'} |"
        )
    return "\n".join(lines)


def emit(kind: str, row: dict[str, Any], results: str | None) -> None:
    """Prints ``KIND {json}`` and appends the row to ``results`` (when given)."""
    line = json.dumps(row)
    print(f"{kind} {line}", flush=True)
    if results:
        os.makedirs(os.path.dirname(os.path.abspath(results)), exist_ok=True)
        with open(results, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")


# --------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (``--tiny``: the tiny model on the CPU, small defaults)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tag", default="longest_pair")
    p.add_argument("--side", choices=("ours", "trl"), default="ours")
    p.add_argument("--model-size", default="qwen1.5b", help="workload.MODEL_SIZES (qwen1.5b, 8b, ...)")
    p.add_argument("--strategy", help="ours: MODE[+offload][+tiled] or auto (full+offload+tiled); trl: gc, liger+gc")
    p.add_argument("--prompt-frac", type=float, default=0.9, help="the prompt's share of the pair's tokens (0.9)")
    p.add_argument("--start", type=int, help="first length tried (tokens P+C+R; 16384, tiny: 128)")
    p.add_argument("--resolution", type=float, default=0.05, help="stop when (failure - longest) <= this x longest")
    p.add_argument("--multiple", type=int, help="lengths tried are multiples of this (256, tiny: 8)")
    p.add_argument("--max-tries", type=int, default=24)
    p.add_argument("--time-limit", type=float, help="seconds the search may take: no try starts or runs past it")
    p.add_argument("--try-timeout", type=float, default=600, help="seconds one try may take (then: timeout)")
    p.add_argument("--max-tokens-cap", type=int, help="CPU stand-in for the GPU: a longer try fails as oom unrun")
    p.add_argument("--logps-chunk-size", type=int, default=4096, help="ours: the chunked head's rows per chunk")
    p.add_argument("--compile", action="store_true", help="ours: torch_compile=True (regional compile)")
    p.add_argument("--no-cudnn-sdp", "--no_cudnn_sdp", dest="no_cudnn_sdp", action="store_true")
    p.add_argument("--tiny", action="store_true", help="the tiny model (CPU smoke test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", help="JSONL file to append to (default: $OUT/results.jsonl when OUT is set)")
    p.add_argument("--summarize", metavar="JSONL", help="only print the markdown table of this file's LONGEST rows")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny and args.model_size not in ("tiny", "tiny-qwen"):
        args.model_size = "tiny"
    args.strategy = args.strategy or ("full+offload+tiled" if args.side == "ours" else "liger+gc")
    args.start = args.start or (128 if args.tiny else 16384)
    args.multiple = args.multiple or (8 if args.tiny else 256)
    if args.results is None and os.environ.get("OUT"):
        args.results = os.path.join(os.environ["OUT"], "results.jsonl")
    if not 0 < args.prompt_frac < 1:
        p.error("--prompt-frac must lie in (0, 1)")
    if args.side == "ours":
        ours_strategy(args.strategy)  # a bad strategy stops here, not after a subprocess
    elif args.strategy not in TRL_STRATEGIES:
        p.error(f"--side trl --strategy: one of {list(TRL_STRATEGIES)}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the search (or one try with ``--child``); returns the ``LONGEST`` row."""
    args = parse_args(argv)
    if args.summarize:
        print(summary_table(args.summarize), flush=True)
        return {}
    if args.child:
        row = run_child(args)
        print("TRY " + json.dumps(row), flush=True)
        return row
    began = time.monotonic()
    args.deadline = None if args.time_limit is None else began + args.time_limit

    def attempt(tokens: int) -> dict[str, Any]:
        row = attempt_in_subprocess(args, tokens)
        emit("TRY", {"kind": "try", "tag": args.tag, **row}, args.results)
        return row

    search = find_longest(
        attempt,
        start=args.start,
        resolution=args.resolution,
        multiple=args.multiple,
        minimum=args.multiple,
        max_tries=args.max_tries,
        time_limit=args.time_limit,
    )
    row = longest_row(args, search, time.monotonic() - began)
    emit("LONGEST", row, args.results)
    return row


if __name__ == "__main__":
    main()
