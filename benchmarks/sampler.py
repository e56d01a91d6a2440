"""Benchmark of the pair planner: per-step balance and planning time on realistic length mixes.

Usage:
    python -m benchmarks.sampler [--pairs 1000000] [--pairs-per-rank 8] [--budget-pairs-per-rank 32]

Prints two markdown tables (fixed count, then token budget). Balance is ``max / mean`` of the loads (summed pair
costs) within one step: over ranks ("rank"), over the micro-batches of one rank ("mb"), and over ranks for the same
micro-batch index ("micro-step"; under ZeRO-3 ranks run micro-steps in lock-step). "med" is the median over steps (or
step-ranks / step-micro-steps), "worst" the maximum. ``random`` rows assign the same global batches to ranks
and micro-batches in permutation order (no balancing). Times: ``plan_epoch_array`` (numpy plan) and
``plan_epoch`` (the same plus the nested Python lists). Budget table: ``M`` = micro-batches per rank per step,
"fill" = real tokens / (``M_step`` x ``B``) over all ranks, "max mb" = the largest micro-batch (<= ``B``), "micro-step
med" = median over micro-steps of max / mean over ranks.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from pair_dpo_trainer.samplers import plan_epoch, plan_epoch_array

MIXES = {
    "lognormal": "prompt U[32,512]; chosen, rejected clip(lognormal(log 200, 0.9), 16, 1024)",
    "heavy": "prompt clip(lognormal(log 300, 1.0), 16, 4096); chosen, rejected clip(lognormal(log 150, 1.5), 8, 4096)",
}


def mix_lengths(mix: str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``[n]`` int64 prompt, chosen and rejected lengths of a named length mix (``MIXES``), drawn from ``rng``."""
    if mix == "lognormal":
        prompt = rng.integers(32, 513, n)
        chosen, rejected = (np.clip(rng.lognormal(np.log(200), 0.9, n), 16, 1024) for _ in range(2))
    else:
        prompt = np.clip(rng.lognormal(np.log(300), 1.0, n), 16, 4096)
        chosen, rejected = (np.clip(rng.lognormal(np.log(150), 1.5, n), 8, 4096) for _ in range(2))
    return prompt.astype(np.int64), chosen.astype(np.int64), rejected.astype(np.int64)


def make_costs(mix: str, n: int, seed: int) -> np.ndarray:
    """Returns ``[n]`` pair costs ``2 * prompt + chosen + rejected`` for a named length mix."""
    prompt, chosen, rejected = mix_lengths(mix, n, np.random.default_rng(seed))
    return 2 * prompt + chosen + rejected


def ratio(loads: np.ndarray, axis: int) -> np.ndarray:
    """``max / mean`` of ``loads`` along ``axis``, flattened."""
    return (loads.max(axis=axis) / loads.mean(axis=axis)).ravel()


def balance(costs: np.ndarray, pairs: np.ndarray, sizes: tuple[int, ...]) -> dict[str, float]:
    """Balance statistics of a plan ``pairs [steps, W, P]`` with micro-batch ``sizes``."""
    loads = costs[pairs]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    mb_loads = np.add.reduceat(loads, starts, axis=2)  # [steps, W, M]
    rank, in_rank, micro = ratio(loads.sum(axis=2), 1), ratio(mb_loads, 2), ratio(mb_loads, 1)
    return {
        "rank med": np.median(rank),
        "rank worst": rank.max(),
        "mb med": np.median(in_rank),
        "mb worst": in_rank.max(),
        "micro-step med": np.median(micro),
    }


def random_assignment(n: int, world_size: int, pairs_per_rank: int, seed: int) -> np.ndarray:
    """The same global batches as the planner, split in permutation order: ``[steps, W, P]``."""
    group = world_size * pairs_per_rank
    steps = n // group
    perm = np.random.default_rng([seed, 0]).permutation(n)[: steps * group]
    return perm.reshape(steps, world_size, pairs_per_rank)


def run_row(costs: np.ndarray, world_size: int, pairs_per_rank: int, microbatches: int, seed: int) -> dict:
    """Plans one epoch and measures it."""
    kwargs = dict(world_size=world_size, pairs_per_rank=pairs_per_rank, microbatches=microbatches, seed=seed)
    start = time.perf_counter()
    plan = plan_epoch_array(costs, epoch=0, **kwargs)
    array_s = time.perf_counter() - start
    start = time.perf_counter()
    plan_epoch(costs, epoch=0, **kwargs)
    lists_s = time.perf_counter() - start
    return {**balance(costs, plan.pairs, plan.microbatch_sizes), "array s": array_s, "lists s": lists_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=1_000_000)
    parser.add_argument("--pairs-per-rank", type=int, default=8)
    parser.add_argument("--budget-pairs-per-rank", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    p = args.pairs_per_rank
    columns = ["rank med", "rank worst", "mb med", "mb worst", "micro-step med", "array s", "lists s"]
    print(f"{args.pairs:,} pairs, pairs_per_rank={p}; mixes: " + "; ".join(f"{k}: {v}" for k, v in MIXES.items()))
    print()
    print("| mix | method | W | M | steps | " + " | ".join(columns) + " |")
    print("|" + "---|" * (5 + len(columns)))
    for mix in MIXES:
        costs = make_costs(mix, args.pairs, args.seed)
        for world_size in (1, 2, 8, 64):
            for microbatches in (2, 4):
                row = run_row(costs, world_size, p, microbatches, args.seed)
                print_row(mix, "plan_epoch", world_size, microbatches, args.pairs // (world_size * p), row)
        for world_size in (8, 64):
            pairs = random_assignment(args.pairs, world_size, p, args.seed)
            row = {
                **balance(costs, pairs, (p // 2, p - p // 2)),
                "array s": float("nan"),
                "lists s": float("nan"),
            }
            print_row(mix, "random", world_size, 2, pairs.shape[0], row)
    print()
    print(f"Token budget (max_tokens_per_microbatch), pairs_per_rank={args.budget_pairs_per_rank}")
    print()
    budget_columns = ["M mean", "M max", "fill", "max mb", "micro-step med", "array s"]
    print("| mix | B | W | steps | " + " | ".join(budget_columns) + " |")
    print("|" + "---|" * (4 + len(budget_columns)))
    for mix in MIXES:
        costs = make_costs(mix, args.pairs, args.seed)
        for budget in (8192, 16384) if mix == "lognormal" else (16384, 32768):  # heavy pairs cost up to 16384
            for world_size in (1, 8, 64):
                steps = args.pairs // (world_size * args.budget_pairs_per_rank)
                row = budget_row(costs, world_size, args.budget_pairs_per_rank, budget, args.seed)
                cells = [f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()]
                print(f"| {mix} | {budget} | {world_size} | {steps:,} | " + " | ".join(cells) + " |")


def budget_row(costs: np.ndarray, world_size: int, pairs_per_rank: int, budget: int, seed: int) -> dict:
    """Plans one epoch with a token budget and measures it: micro-batches per step, fill (real tokens over
    ``M_step * B``), largest micro-batch, micro-step balance over ranks, planning time."""
    kwargs = dict(world_size=world_size, pairs_per_rank=pairs_per_rank, max_tokens_per_microbatch=budget, seed=seed)
    start = time.perf_counter()
    plan = plan_epoch_array(costs, epoch=0, **kwargs)
    array_s = time.perf_counter() - start
    rows, sizes = plan.pairs.reshape(-1, pairs_per_rank), plan.sizes.reshape(-1, plan.sizes.shape[2])
    ends = np.cumsum(sizes, axis=1)
    prefix = np.concatenate([np.zeros((rows.shape[0], 1), dtype=np.int64), np.cumsum(costs[rows], axis=1)], axis=1)
    loads = (np.take_along_axis(prefix, ends, 1) - np.take_along_axis(prefix, ends - sizes, 1)).reshape(
        plan.sizes.shape
    )
    counts = plan.microbatch_counts
    used = loads[:, 0, :] > 0  # [steps, M_max]: the step's micro-steps
    micro = loads.max(axis=1) / np.maximum(loads.mean(axis=1), 1)
    return {
        "M mean": counts.mean(),
        "M max": counts.max(),
        "fill": loads.sum() / (counts.sum() * world_size * budget),
        "max mb": loads.max(),
        "micro-step med": np.median(micro[used]),
        "array s": array_s,
    }


def print_row(mix: str, method: str, world_size: int, microbatches: int, steps: int, row: dict) -> None:
    """Prints one markdown table row."""
    cells = [f"{v:.3f}" if v == v else "-" for v in row.values()]
    print(f"| {mix} | {method} | {world_size} | {microbatches} | {steps:,} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
