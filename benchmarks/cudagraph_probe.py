"""Probe: do the trainer's regionally compiled decoder layers run under CUDA graphs once rows have one shape?

``torch_compile_mode="reduce-overhead"`` (CUDA graphs) is refused by the config. ``pad_to_budget=True`` makes every
packed row exactly ``max_tokens_per_microbatch`` tokens, which removes the row-length half of the objection; the
other half is that the trainer compiles each decoder layer on its own (``modeling/compile.py``), so one compiled
graph is called once per layer with the previous call's output as input, a pattern CUDA graph trees do not support
(PyTorch issue #152887: "accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run"). This
probe settles it on the GPU: a small random Llama with ``pair_varlen`` attention, rows padded to ``--budget`` tokens
(``PackedPairCollator(pad_to_length=...)``, 1-6 pairs each), each decoder layer compiled in place with ``--mode``
(bypassing the refusal), ``--steps`` micro-batches of policy forward + backward each followed by a no-grad forward
(the reference pattern), compared with an eager copy. Prints ``PROBE {json}`` (``ok``, ``error``, ``max_rel_diff``
of the per-sequence log-probs, ``grad_cosine``, ``dynamo_graphs``, ``seconds``) and appends it to
``$OUT/probe.jsonl``.

Examples:
    python -m benchmarks.cudagraph_probe                       # GPU: inductor, reduce-overhead
    python -m benchmarks.cudagraph_probe --mark-step           # the same with cudagraph_mark_step_begin()
    python -m benchmarks.cudagraph_probe --backend aot_eager --mode default --budget 256   # CPU smoke test
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pair_dpo_trainer.collators.packed import PackedPairCollator
from pair_dpo_trainer.modeling.attention import enable_pair_varlen
from pair_dpo_trainer.modeling.compile import decoder_layers
from pair_dpo_trainer.modeling.logprobs import packed_sequence_logps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", type=int, default=4096, help="row length of every micro-batch (pad_to_budget)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--mode", default="reduce-overhead", help="torch.compile mode of every decoder layer")
    p.add_argument("--mark-step", action="store_true", help="torch.compiler.cudagraph_mark_step_begin() per step")
    p.add_argument("--attn-backend", default="auto")
    return p.parse_args(argv)


def rows(budget: int, steps: int, vocab: int, seed: int = 0) -> list:
    """``steps`` packed rows of exactly ``budget`` tokens, 1-6 random pairs each."""
    rng, collator = random.Random(seed), PackedPairCollator(pad_to_length=budget)
    out = []
    for _ in range(steps):
        pairs, cost = [], 0
        for _ in range(rng.randint(1, 6)):
            lengths = [rng.randint(2, budget // 24) for _ in range(3)]
            if cost + 2 * lengths[0] + lengths[1] + lengths[2] > budget:
                break
            cost += 2 * lengths[0] + lengths[1] + lengths[2]
            ids = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
            pairs.append(dict(zip(("prompt_input_ids", "chosen_input_ids", "rejected_input_ids"), ids, strict=True)))
        out.append(collator(pairs or [{"prompt_input_ids": [3], "chosen_input_ids": [4], "rejected_input_ids": [5]}]))
    return out


def step(model: torch.nn.Module, batch, cuda: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Policy fwd + bwd, then a no-grad forward; returns (per-sequence logps, flattened gradient)."""
    with torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=cuda):
        logps = packed_sequence_logps(model, batch, chunk_size=4096)
        logps.sum().backward()
        with torch.no_grad():
            packed_sequence_logps(model, batch, chunk_size=4096)
    grad = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return logps.detach().float().clone(), grad


def probe(args: argparse.Namespace) -> dict:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    config = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=4, vocab_size=32000, max_position_embeddings=args.budget,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    backend = enable_pair_varlen(model, args.attn_backend)
    eager = copy.deepcopy(model)
    for layer in decoder_layers(model):
        layer.compile(backend=args.backend, mode=None if args.mode == "default" else args.mode, dynamic=True)
    result = {"probe": "cudagraph_regional_layers", "mode": args.mode, "backend": args.backend, "attn": backend}
    result.update(budget=args.budget, layers=args.layers, mark_step=args.mark_step, ok=False, error=None)
    start, diffs, cosines = time.perf_counter(), [], []
    try:
        for batch in rows(args.budget, args.steps, config.vocab_size):
            batch = batch.to(device)
            if args.mark_step:
                torch.compiler.cudagraph_mark_step_begin()
            compiled_logps, compiled_grad = step(model, batch, cuda)
            eager_logps, eager_grad = step(eager, batch, cuda)
            diffs.append(float(((compiled_logps - eager_logps).abs() / eager_logps.abs().clamp_min(1)).max()))
            cosines.append(float(torch.nn.functional.cosine_similarity(compiled_grad, eager_grad, dim=0)))
        result["ok"] = True
    except Exception as exc:  # the outcome to record, whatever it is
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    from torch._dynamo.utils import counters

    result.update(
        steps_done=len(diffs),
        max_rel_diff=max(diffs) if diffs else None,
        grad_cosine=min(cosines) if cosines else None,
        dynamo_graphs=int(counters["stats"]["unique_graphs"]),
        seconds=round(time.perf_counter() - start, 1),
    )
    return result


def main(argv: list[str] | None = None) -> dict:
    result = probe(parse_args(argv))
    print("PROBE " + json.dumps(result), flush=True)
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"]) / "probe.jsonl", "a") as handle:
            handle.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
