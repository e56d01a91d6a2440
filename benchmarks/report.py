"""Results of ``benchmarks.dpo`` and ``benchmarks.trl_dpo``: the ``RESULT``/``CEILING`` JSON lines, the markdown
summary table, per-GPU ratios.

Standalone (no torch import, so it is fast at the end of a device call)::

    python3 -m benchmarks.report $OUT/results.jsonl --ratio ours_compile trl_sdpa --ratio ours_z3 ours_1gpu
    python3 -m benchmarks.report $OUT/results.jsonl --also /tmp/other_results.jsonl --ratio a b

A ``--ratio`` operand is ``TAG`` (the run's main row: ``impl`` ``pair_dpo``, or a TRL row) or ``TAG:IMPL`` (e.g.
``ours:pair_dpo_ceiling``); tok/s is the mean of ``real_tok_s_gpu`` over the ranks' rows, so the ratio is per GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def emit(prefix: str, row: dict[str, Any], results: str | None) -> None:
    """Prints ``PREFIX {json}`` and appends the row to ``results`` (JSONL) when set."""
    line = json.dumps(row)
    print(f"{prefix} {line}", flush=True)
    if results:
        Path(results).parent.mkdir(parents=True, exist_ok=True)
        with open(results, "a") as handle:
            handle.write(line + "\n")


SUMMARY_COLUMNS = (
    ("tag", "tag"),
    ("impl", "impl"),
    ("rank", "rank"),
    ("world", "world"),
    ("bs_pairs", "pairs/step"),
    ("real_tokens_per_step", "tokens/step"),
    ("step_median_s", "median step s"),
    ("real_tok_s_gpu", "tok/s/GPU"),
    ("padding_frac", "padding"),
    ("peak_alloc_gib", "peak GiB"),
    ("peak_reserved_gib", "reserved GiB"),
    ("mfu8N_989", "MFU 8N all"),
    ("mfu_noembed_989", "MFU kN non-emb"),
    ("gpu_sm_clock_mhz_median", "SM MHz"),
    ("gpu_power_capped_frac", "power-capped"),
    ("compile", "compile"),
    ("dynamo_graphs_timed", "graphs in timed steps"),
    ("ours_over_ceiling", "ours/ceiling"),
    ("ours_over_ceiling_shape", "ours/shape ceiling"),
)


def summary_table(path: str) -> str:
    """A markdown table of the rows of a results JSONL file (TRL rows have no ``impl``: shown as ``trl``)."""
    lines = ["| " + " | ".join(title for _, title in SUMMARY_COLUMNS) + " |"]
    lines.append("|" + "---|" * len(SUMMARY_COLUMNS))
    for text in Path(path).read_text().splitlines():
        row = {"impl": "trl", **json.loads(text)}
        lines.append("| " + " | ".join(str(row.get(key, "")) for key, _ in SUMMARY_COLUMNS) + " |")
    return "\n".join(lines)


def load_rows(*paths: str) -> list[dict[str, Any]]:
    """The rows of the given JSONL files that exist (TRL rows get ``impl: "trl"``)."""
    rows = []
    for path in paths:
        if Path(path).is_file():
            rows += [{"impl": "trl", **json.loads(t)} for t in Path(path).read_text().splitlines() if t.strip()]
    return rows


def per_gpu_tok_s(rows: list[dict[str, Any]], key: str) -> tuple[float, int] | None:
    """``(mean real_tok_s_gpu over ranks, number of rows)`` of ``TAG`` / ``TAG:IMPL`` (see the module docstring)."""
    tag, _, impl = key.partition(":")
    found = [
        r["real_tok_s_gpu"]
        for r in rows
        if r.get("tag") == tag and (r.get("impl") == impl if impl else r.get("impl") in ("pair_dpo", "trl"))
    ]
    return (statistics.fmean(found), len(found)) if found else None


def ratio_line(rows: list[dict[str, Any]], num: str, den: str) -> str:
    """``RATIO num/den = x (a / b tok/s per GPU, n1 and n2 rank rows)``, or why it cannot be computed."""
    a, b = per_gpu_tok_s(rows, num), per_gpu_tok_s(rows, den)
    if a is None or b is None:
        return f"RATIO {num}/{den}: missing {' and '.join(k for k, v in ((num, a), (den, b)) if v is None)}"
    return f"RATIO {num}/{den} = {a[0] / b[0]:.3f} per GPU ({a[0]:.0f} / {b[0]:.0f} tok/s; {a[1]} and {b[1]} rank rows)"


def memory_lines(rows: list[dict[str, Any]], pairs: Sequence[tuple[str, str]]) -> list[str]:
    """``MEM`` lines (peak memory, micro-batches per step) of the main rows the ``pairs`` name (ours' or TRL's),
    then ``MEM RATIO a/b`` of peak allocated and reserved GiB (rank 0 rows)."""
    main = {r.get("tag"): r for r in rows if r.get("impl") in ("pair_dpo", "trl") and r.get("rank", 0) == 0}
    lines = []
    for tag in dict.fromkeys(t for pair in pairs for t in pair):
        if tag in main:
            r = main[tag]
            lines.append(
                f"MEM {tag}: peak_alloc {r.get('peak_alloc_gib')} GiB, reserved {r.get('peak_reserved_gib')} GiB, "
                f"micro-batches/step {r.get('microbatches_per_step_mean')} (max {r.get('microbatches_per_step_max')}), "
                f"max row {r.get('microbatch_tokens_max')}, alloc_conf {r.get('alloc_conf')}"
            )
    for a, b in pairs:
        if a in main and b in main and main[b].get("peak_alloc_gib") and main[b].get("peak_reserved_gib"):
            alloc = main[a]["peak_alloc_gib"] / main[b]["peak_alloc_gib"]
            reserved = main[a]["peak_reserved_gib"] / main[b]["peak_reserved_gib"]
            lines.append(f"MEM RATIO {a}/{b}: alloc {alloc:.3f}, reserved {reserved:.3f}")
        else:
            lines.append(f"MEM RATIO {a}/{b}: missing rows or memory fields")
    return lines


def main(argv: list[str] | None = None) -> None:
    """Prints the summary table of a results file, then the requested per-GPU ratios."""
    p = argparse.ArgumentParser(description="summary table and per-GPU ratios of benchmark results")
    p.add_argument("results", help="results JSONL (its rows make the table)")
    p.add_argument("--also", action="append", default=[], help="more JSONL files whose rows --ratio may use")
    p.add_argument("--ratio", nargs=2, action="append", default=[], metavar=("NUM", "DEN"))
    p.add_argument("--no-table", action="store_true")
    args = p.parse_args(argv)
    if not args.no_table and Path(args.results).is_file():
        print(summary_table(args.results))
    rows = load_rows(args.results, *args.also)
    for num, den in args.ratio:
        print(ratio_line(rows, num, den))


if __name__ == "__main__":
    main()
