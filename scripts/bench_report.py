"""Results of ``scripts/bench_dpo.py``: the ``RESULT``/``CEILING`` JSON lines and the markdown summary table."""

from __future__ import annotations

import json
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
    ("mfu8N_989", "MFU 8N all"),
    ("mfu_noembed_989", "MFU kN non-emb"),
    ("ours_over_ceiling", "ours/ceiling"),
)


def summary_table(path: str) -> str:
    """A markdown table of the rows of a results JSONL file (TRL rows have no ``impl``: shown as ``trl``)."""
    lines = ["| " + " | ".join(title for _, title in SUMMARY_COLUMNS) + " |"]
    lines.append("|" + "---|" * len(SUMMARY_COLUMNS))
    for text in Path(path).read_text().splitlines():
        row = {"impl": "trl", **json.loads(text)}
        lines.append("| " + " | ".join(str(row.get(key, "")) for key, _ in SUMMARY_COLUMNS) + " |")
    return "\n".join(lines)
