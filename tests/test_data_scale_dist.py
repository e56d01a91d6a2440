"""Data at scale with 2 real processes on one node (torchrun, gloo on CPU): only the local main tokenises and hashes the
reference snapshot; the other rank waits, memory-maps the same Arrow files and checks the proof. One launch runs
every phase (tests/data_scale_worker.py)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from pair_dpo_trainer.data.cache import PairCache
from pair_dpo_trainer.data.pairs import build_pairs
from pair_dpo_trainer.demo import bundled_model_dir
from pair_dpo_trainer.demo.pairs import generate_demo_pairs
from tests.launch import torchrun
from tests.ports import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("data_scale")
    # HF_DATASETS_CACHE: shared by both ranks, fresh for this launch
    torchrun("data_scale_worker.py", out_dir, port=free_port(), env={"HF_DATASETS_CACHE": str(out_dir / "hf_cache")})
    return {
        (phase, rank): json.loads((out_dir / f"{phase}_rank{rank}.json").read_text())
        for phase in ("once", "parallel", "bad")
        for rank in (0, 1)
    }


def test_only_the_local_main_tokenises_the_other_rank_memory_maps(results):
    main, other = results["once", 0], results["once", 1]
    assert main["tokenize_pair_calls"] == 300 + 40  # every train and eval row, once
    assert other["tokenize_pair_calls"] == 0
    assert main["train_files"] == other["train_files"] and main["eval_files"] == other["eval_files"]
    assert main["train_meta"]["created_by"]["pid"] == main["pid"] != other["pid"]
    assert main["losses"] == other["losses"] and len(main["losses"]) == 2  # and both ranks trained on them


def test_only_the_local_main_hashes_the_snapshot_the_other_rank_checks_its_proof(results):
    main, other = results["once", 0], results["once", 1]
    assert main["files_hashed"] == main["snapshot_files"] > 3
    assert other["files_hashed"] == 0
    assert other["manifest_digest"] == main["manifest_digest"]


def test_with_workers_only_the_local_main_converts(results):
    main, other = results["parallel", 0], results["parallel", 1]
    assert main["train_meta"]["num_proc"] == 2 and main["train_meta"]["created_by"]["pid"] == main["pid"]
    assert main["train_files"] == other["train_files"] and main["rows"] == other["rows"] == 700
    assert other["tokenize_pair_calls"] == 0 < main["tokenize_pair_calls"]  # the main's first chunk, in-process


def test_a_bad_row_stops_every_rank_with_its_code(results):
    """The waiting rank raises the local main's error as itself (a hang would run the launch into its timeout)."""
    for rank in (0, 1):
        result = results["bad", rank]
        assert result["reason_code"] == "schema", result
        assert "train dataset row 400:" in result["message"]
    assert results["bad", 0]["message"] == results["bad", 1]["message"]


def test_the_pairs_are_the_same_bytes_in_another_process(results, tmp_path):
    """Determinism across runs: the launch's entry and one built here, in another interpreter, are byte-identical."""
    meta = results["parallel", 0]["train_meta"]
    tok = AutoTokenizer.from_pretrained(bundled_model_dir())
    limits = {"max_length": 128, "max_prompt_length": 64, "max_tokens_per_microbatch": None}
    built = build_pairs(
        generate_demo_pairs(seed=7, n=700),
        tok,
        limits,
        tokenized=False,
        desc="train dataset",
        num_proc=1,
        cache=PairCache(tmp_path),
    )
    assert built.entry.meta["key"] == meta["key"]
    assert built.entry.meta["result"]["sha256"] == meta["result"]["sha256"]
