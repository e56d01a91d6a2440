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


@pytest.mark.parametrize("fused", [False, True])
def test_resident_optimizer_state_leaves_the_weights_and_the_next_step_as_they_were(fused):
    """The zero-rate step makes AdamW's moments resident and changes nothing a run sees: the weights are bitwise
    the same, no gradient is left, the learning rate is restored, and the next real step moves the weights with a
    first moment of ``(1 - beta1) * g``, as from zero moments."""
    import torch

    from benchmarks.longest_pair import materialize_optimizer_state

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    size = materialize_optimizer_state(optimizer)
    moments = sum(2 * 4 * p.numel() for p in model.parameters())
    assert moments <= size <= moments + 4 * 4  # two float32 moments per parameter, and a step counter per tensor
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert optimizer.param_groups[0]["lr"] == 1e-2
    for p in model.parameters():
        state = optimizer.state[p]
        assert torch.count_nonzero(state["exp_avg"]) == 0 and torch.count_nonzero(state["exp_avg_sq"]) == 0
    model(torch.randn(3, 8)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    optimizer.step()
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    for name, p in model.named_parameters():
        assert torch.allclose(optimizer.state[p]["exp_avg"], 0.1 * grads[name]), name  # (1 - beta1) * g


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
    assert tries[0]["optimizer_state_gib"] > 0  # AdamW's moments were resident before the step
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
    assert tries[0]["optimizer_state_gib"] > 0
    assert row["longest_tokens"] == 64 and row["longest_sequence"] == 61
