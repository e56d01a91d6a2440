"""``benchmarks.longest_pair``: the doubling-then-bisection search against known limits (in process, cheap), then the
real path once: the search runs each try in a fresh subprocess, the tiny model trains one step on CPU and
``--max-tokens-cap`` stands in for the GPU's out-of-memory; the table of the result rows."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from benchmarks import longest_pair
from benchmarks.longest_pair import FAILURES, find_longest, pair_lengths

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("limit,start", [(1000, 64), (1000, 4096), (70_000, 16384), (5000, 5000), (100, 64)])
def test_the_search_brackets_the_true_limit_within_the_resolution(limit, start):
    tried = []

    def attempt(tokens):
        tried.append(tokens)
        return {"tokens": tokens, "status": "ok" if tokens <= limit else "oom"}

    search = find_longest(attempt, start=start, resolution=0.05, multiple=8, minimum=8)
    assert search.longest <= limit < search.first_failure
    assert search.first_failure - search.longest <= max(0.05 * search.longest, 8)
    assert len(tried) == len(set(tried)) and len(tried) <= 14  # no length twice; log-many tries
    assert all((t <= limit) == (row["status"] == "ok") for t, row in zip(tried, search.tries, strict=True))


def test_nothing_fits_and_an_error_stops_the_search():
    none = find_longest(lambda t: {"tokens": t, "status": "timeout"}, start=1024, multiple=64, minimum=64)
    assert none.longest == 0 and none.first_failure == 64 and none.stopped == "nothing fits down to 64 tokens"
    assert [row["tokens"] for row in none.tries] == [1024, 512, 256, 128, 64]
    assert "timeout" in FAILURES

    def broken(tokens):
        return {"tokens": tokens, "status": "ok" if tokens < 2000 else "error", "error": "ValueError: a bug"}

    stopped = find_longest(broken, start=1024, multiple=64, minimum=64)
    assert stopped.longest == 1024 and stopped.first_failure is None and "a bug" in stopped.stopped


def test_pair_lengths_keep_the_ratio_and_the_total():
    for tokens in (64, 1000, 12_345, 262_144):
        prompt, chosen, rejected = pair_lengths(tokens, 0.9)
        assert prompt + chosen + rejected == tokens and abs(prompt - 0.9 * tokens) <= 1.5 and chosen == rejected


def _search(tmp_path, monkeypatch, *flags):
    results = tmp_path / "rows.jsonl"
    for name, value in (("PYTHONPATH", str(ROOT)), ("OMP_NUM_THREADS", "1"), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)  # the tries' subprocesses import this checkout
    row = longest_pair.main(["--tiny", "--results", str(results), *flags])
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    return row, lines, results


@pytest.mark.integration
@pytest.mark.slow  # two subprocesses, one training the tiny model (~15 s on 2 cores)
def test_the_search_trains_each_try_in_a_subprocess_and_the_cap_stands_in_for_oom(tmp_path, monkeypatch, capsys):
    row, lines, results = _search(
        tmp_path, monkeypatch, "--strategy", "full+offload+tiled", "--start", "128", "--max-tokens-cap", "200",
        "--resolution", "1",
    )  # fmt: skip
    tries = [line for line in lines if line["kind"] == "try"]
    assert [(t["tokens"], t["status"]) for t in tries] == [(128, "ok"), (256, "oom")]
    assert tries[0]["prompt"] == 116 and tries[0]["trl_tokens"] == 128 + 116 and tries[1]["simulated"]
    assert "MLP in tiles" in tries[0]["layers"] and "offloaded" in tries[0]["layers"]  # what the child trained
    assert row["longest_tokens"] == 128 and row["first_failure_tokens"] == 256 and row["resolved"]
    assert lines[-1] == row
    longest_pair.main(["--summarize", str(results)])
    table = capsys.readouterr().out.splitlines()[-3:]
    assert table[0].startswith("| model | side |") and "| tiny | ours | `full+offload+tiled` | 128 | 244 |" in table[2]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="the TRL side needs trl")
def test_the_trl_side_trains_one_pair_with_gradient_checkpointing(tmp_path, monkeypatch):
    row, lines, _ = _search(
        tmp_path, monkeypatch, "--side", "trl", "--strategy", "gc", "--start", "64", "--max-tokens-cap", "100",
        "--resolution", "1",
    )  # fmt: skip
    tries = [line for line in lines if line["kind"] == "try"]
    assert [(t["tokens"], t["status"]) for t in tries] == [(64, "ok"), (128, "oom")], tries
    assert tries[0]["trl_rows_shape"] == [2, 58 + 3]  # chosen and rejected rows of P + C tokens
    assert row["longest_tokens"] == 64 and row["longest_sequence"] == 61
