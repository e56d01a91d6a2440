"""Data at scale, in one process. Parallel conversion gives the same bytes for any worker count, the
tokenised-pairs cache is reused and invalidated by exactly what it is keyed on, pairs are memory-mapped Arrow on every
path, inputs are streamed, and the snapshot proof is trusted only where it matches (the 2-process behaviour:
tests/test_data_scale_dist.py)."""

from __future__ import annotations

import copy
import datetime
import errno
import hashlib
import json
import os
import pickle
import random
import shutil
import threading
import time
import tracemalloc
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch.distributed as dist
from transformers import AutoTokenizer

from pair_dpo_trainer import PairDPOConfig, PairDPOTrainer
from pair_dpo_trainer.cli import main as cli_main
from pair_dpo_trainer.data.cache import PairCache
from pair_dpo_trainer.data.costs import pair_cost_array
from pair_dpo_trainer.data.pairs import build_pairs
from pair_dpo_trainer.data.prepared import load_prepared
from pair_dpo_trainer.data.streams import FileStream
from pair_dpo_trainer.data.tokenize import FEATURE_COLUMNS, tokenize_dataset
from pair_dpo_trainer.data.workers import CHUNK_ROWS
from pair_dpo_trainer.demo import DEMO_REVISION, bundled_model_dir
from pair_dpo_trainer.demo.pairs import generate_demo_pairs
from pair_dpo_trainer.errors import ConfigError, PreferenceRowError, SnapshotIntegrityError
from pair_dpo_trainer.integrity import proof as proof_module
from pair_dpo_trainer.integrity.proof import verify_and_prove, verify_with_proof
from pair_dpo_trainer.reference.precompute import dataset_fingerprint
from tests.dpo_fixtures import cpu_config
from tests.models import tiny_llama
from tests.ports import free_port
from tests.timing import scaled

LIMITS = {"max_length": 128, "max_prompt_length": 64, "max_tokens_per_microbatch": None}
BAD_ROWS = {300: {"prompt": "x"}, 520: {"prompt": "x", "chosen": " 1", "rejected": " 1"}, 700: ["not", "a", "row"]}


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(bundled_model_dir())


def _rows(n: int, bad: dict | None = None) -> list:
    rows: list = list(generate_demo_pairs(seed=4, n=n))
    for index, row in (bad or {}).items():
        rows[index] = row
    return rows


def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _build(rows, tok, cache_dir, *, num_proc=1, limits=LIMITS, tokenized=False):
    return build_pairs(
        rows,
        tok,
        limits,
        tokenized=tokenized,
        desc="train dataset",
        num_proc=num_proc,
        cache=PairCache(cache_dir),
    )


# ------------------------------------------------------------------------------------------------ worker counts


@pytest.mark.slow
def test_prepare_data_is_byte_identical_for_1_2_and_3_workers(tmp_path, capsys):
    rows = _rows(900, BAD_ROWS)  # 4 chunks; the bad rows in chunks 1, 2 and 2
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    outputs, printed = {}, {}
    for workers in (1, 2, 3):
        out = tmp_path / f"out{workers}"
        argv = ["prepare-data", str(source), "--output", str(out), "--tokenizer", str(bundled_model_dir())]
        argv += ["--train-size", "700", "--eval-size", "100", "--seed", "3", "--num-proc", str(workers)]
        assert cli_main([*argv, "--disable-tqdm"]) == 0
        outputs[workers] = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
        printed[workers] = capsys.readouterr().out.replace(str(out), "OUT")
    assert len(rows) > 3 * CHUNK_ROWS and sorted(outputs[1]) == [
        "eval.arrow",
        "eval.jsonl",
        "manifest.json",
        "train.arrow",
        "train.jsonl",
    ]
    assert outputs[1] == outputs[2] == outputs[3]
    assert printed[1] == printed[2] == printed[3]
    manifest = json.loads(outputs[1]["manifest.json"])
    assert manifest["rejections"] == {"identical_after_truncation": 1, "schema": 2}
    assert "[schema] in.jsonl row 301:" in printed[1]  # the first schema row in input order, from chunk 1
    # an independent, sequential computation of the same rows: the accepted ids, in input order
    expected = tokenize_dataset(
        rows, AutoTokenizer.from_pretrained(bundled_model_dir()), max_length=1024, max_prompt_length=512
    )
    got = {}
    for name in ("train.jsonl", "eval.jsonl"):
        for line in outputs[1][name].decode().splitlines():
            row = json.loads(line)
            got[row["source_row"] - 1] = {c: row[c] for c in FEATURE_COLUMNS}
    assert sorted(got) == [i for i in expected.row_indices if i in got] and len(got) == 800
    for index, features in zip(expected.row_indices, expected.features, strict=True):
        if index in got:
            assert got[index] == features


@pytest.mark.slow
def test_trainer_pairs_are_the_same_bytes_for_1_2_and_3_workers(tmp_path, tok):
    rows = _rows(700)
    built = {n: _build(rows, tok, tmp_path / f"cache{n}", num_proc=n) for n in (1, 2, 3)}
    hashes = {n: b.entry.meta["result"]["sha256"] for n, b in built.items()}
    assert len(set(hashes.values())) == 1 and all(_sha(b.entry.arrow_path) == hashes[1] for b in built.values())
    assert built[3].entry.meta["num_proc"] == 3 and built[1].entry.meta["num_proc"] == 1
    expected = tokenize_dataset(rows, tok, **LIMITS, strict=True).features  # in-process, Python lists
    assert [{c: r[c] for c in FEATURE_COLUMNS} for r in built[2].dataset] == expected


def test_a_strict_conversion_raises_the_first_bad_row_in_input_order_and_publishes_nothing(tmp_path, tok):
    rows = _rows(700, {650: {"prompt": "x"}, 400: ["not", "a", "row"]})  # chunk 2's row fails before chunk 1's
    with pytest.raises(PreferenceRowError) as info:
        _build(rows, tok, tmp_path / "cache", num_proc=2)
    assert info.value.reason_code == "schema" and "train dataset row 400:" in info.value.message
    assert not list((tmp_path / "cache").glob("*"))  # no entry, no temporary directory left


def test_a_worker_error_with_a_reason_code_arrives_as_itself(tmp_path, tok):
    no_eos = copy.deepcopy(tok)
    no_eos.eos_token = None
    with pytest.raises(ConfigError) as info:
        _build(_rows(600), no_eos, tmp_path / "cache", num_proc=2)
    assert info.value.reason_code == "bad_tokenizer"


# ------------------------------------------------------------------------------------------------ the cache


def test_the_cache_is_reused_and_invalidated_by_tokenizer_limits_and_rows(tmp_path, tok):
    rows, cache = _rows(40), tmp_path / "cache"
    first = _build(rows, tok, cache)
    assert first.here and first.entry.meta["created_by"]["pid"] == os.getpid()
    mtime = first.entry.arrow_path.stat().st_mtime_ns
    again = _build(copy.deepcopy(rows), tok, cache)  # equal rows, other objects: the same key
    assert not again.here and again.entry.directory == first.entry.directory
    assert again.entry.arrow_path.stat().st_mtime_ns == mtime  # not rewritten
    assert again.dataset.cache_files[0]["filename"] == str(first.entry.arrow_path)  # memory-mapped from the cache
    other_template = copy.deepcopy(tok)
    other_template.chat_template = tok.chat_template.replace("<|assistant|>", "<|bot|>")
    changed_row = copy.deepcopy(rows)
    changed_row[7]["chosen"][0]["content"] += " 1"
    variants = {
        "tokenizer": _build(rows, other_template, cache),
        "limits": _build(rows, tok, cache, limits={**LIMITS, "max_prompt_length": 32}),
        "budget": _build(rows, tok, cache, limits={**LIMITS, "max_tokens_per_microbatch": 4096}),
        "rows": _build(changed_row, tok, cache),
    }
    directories = {first.entry.directory, *(b.entry.directory for b in variants.values())}
    assert len(directories) == 5 and all(b.here for b in variants.values())
    assert variants["rows"].dataset[7]["chosen_input_ids"] != first.dataset[7]["chosen_input_ids"]


def test_a_damaged_entry_is_rebuilt(tmp_path, tok):
    rows, cache = _rows(30), tmp_path / "cache"
    first = _build(rows, tok, cache)
    expected = [dict(r) for r in first.dataset]
    with open(first.entry.arrow_path, "ab") as f:
        f.write(b"\0" * 8)  # no longer the recorded size
    rebuilt = _build(rows, tok, cache)
    assert rebuilt.here and rebuilt.entry.directory == first.entry.directory
    assert [dict(r) for r in rebuilt.dataset] == expected


def test_an_unwritable_cache_is_a_config_error(tmp_path, tok):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError) as info:
        _build(_rows(5), tok, blocker / "cache")
    assert info.value.reason_code == "dataset_cache_unwritable" and "dataset_cache_dir" in info.value.message


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES])
def test_a_write_that_fails_for_the_disk_is_a_config_error_and_leaves_no_partial_entry(tmp_path, code):
    cache = PairCache(tmp_path / "cache")

    def build(directory: Path) -> dict:
        (directory / "pairs.arrow").write_bytes(b"\0" * 4096)  # half an entry, then the disk refuses
        raise OSError(code, os.strerror(code))

    with pytest.raises(ConfigError) as info:
        cache.get_or_build({"rows": 1}, build)
    assert info.value.reason_code == "dataset_cache_unwritable"
    assert str(cache.root) in info.value.message and "dataset_cache_dir" in info.value.message
    assert " free of " in info.value.message  # the filesystem's free space, from shutil.disk_usage
    assert list(cache.root.iterdir()) == []  # neither the entry nor its temporary directory


def test_a_build_that_fails_for_another_reason_is_raised_as_it_is(tmp_path):
    cache = PairCache(tmp_path / "cache")

    def build(directory: Path) -> dict:
        raise OSError(errno.EIO, "Input/output error")

    with pytest.raises(OSError) as info:
        cache.get_or_build({"rows": 1}, build)
    assert info.value.errno == errno.EIO and not isinstance(info.value, ConfigError)
    assert list(cache.root.iterdir()) == []


def test_the_trainer_uses_the_configured_cache_and_memory_maps_raw_rows(tmp_path, tok):
    cache = tmp_path / "my-cache"
    args = cpu_config(tmp_path, dataset_cache_dir=str(cache), dataset_num_proc=2, max_length=128, max_prompt_length=64)
    trainer = PairDPOTrainer(model=tiny_llama(0, len(tok)), args=args, train_dataset=_rows(20), processing_class=tok)
    assert isinstance(trainer.train_dataset, datasets.Dataset)
    (filename,) = (f["filename"] for f in trainer.train_dataset.cache_files)
    assert Path(filename).parent.parent == cache and Path(filename).name == "pairs.arrow"
    costs = trainer._costs(trainer.train_dataset)
    assert isinstance(costs, np.ndarray) and costs.dtype == np.int64
    prompt_copies = 1 if trainer.share_prompt else 2  # the run's packed layout: each prompt once where shared
    expected = [
        prompt_copies * len(r["prompt_input_ids"]) + len(r["chosen_input_ids"]) + len(r["rejected_input_ids"])
        for r in trainer.train_dataset
    ]
    assert trainer.share_prompt and costs.tolist() == expected


def _losses(tmp_path, tok, train_dataset, **options) -> list[float]:
    args = cpu_config(
        tmp_path,
        ref_model_revision=DEMO_REVISION,
        max_length=128,
        max_prompt_length=64,
        max_steps=3,
        seed=11,
        **options,
    )
    model = str(bundled_model_dir())  # the tokenizer's vocabulary
    trainer = PairDPOTrainer(model=model, args=args, train_dataset=train_dataset, processing_class=tok)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.integration
def test_the_whole_pipeline_is_deterministic_across_runs_and_equals_the_list_path(tmp_path, tok):
    """Raw rows -> cache (1 or 2 workers, fresh caches) -> memory-mapped pairs -> training: the same losses in every
    run, and the same as training on the pairs tokenised in this process into Python lists (the path before)."""
    rows = _rows(600)
    runs = [_losses(tmp_path / f"run{n}", tok, rows, dataset_num_proc=n, dataset_cache_dir=str(tmp_path / f"c{n}"))
            for n in (1, 2)]  # fmt: skip
    lists = tokenize_dataset(rows, tok, **LIMITS, strict=True).features  # list[dict[str, list[int]]]
    expected = _losses(tmp_path / "lists", tok, lists, dataset_cache_dir=str(tmp_path / "unused"))
    assert len(expected) == 3 and runs[0] == runs[1] == expected
    assert not (tmp_path / "unused").exists()  # the list path wrote nothing: an independent computation


@pytest.mark.parametrize("value", [0, -2, 1.5, True])
def test_dataset_num_proc_must_be_a_positive_count(tmp_path, value):
    with pytest.raises(ConfigError) as info:
        PairDPOConfig(output_dir=str(tmp_path), dataset_num_proc=value, use_cpu=True, report_to="none")
    assert info.value.reason_code == "bad_num_proc"


# ------------------------------------------------------------------------------------------------ every path is Arrow


def test_pair_costs_come_from_the_arrow_lengths(tok):
    features = tokenize_dataset(_rows(30), tok, **LIMITS, strict=True).features
    dataset = datasets.Dataset.from_list(features).select([5, 0, 29, 5])  # an indices mapping
    expected = [
        2 * len(f["prompt_input_ids"]) + len(f["chosen_input_ids"]) + len(f["rejected_input_ids"])
        for f in (features[5], features[0], features[29], features[5])
    ]
    costs = pair_cost_array(dataset)
    assert costs.dtype == np.int64 and costs.tolist() == expected


def test_a_pre_tokenised_dataset_that_needs_cutting_is_memory_mapped_with_its_columns(tmp_path, tok):
    features = tokenize_dataset(_rows(20), tok, max_length=4096, max_prompt_length=2048, strict=True).features
    dataset = datasets.Dataset.from_list([{**f, "note": i} for i, f in enumerate(features)])
    built = _build(dataset, tok, tmp_path / "cache", tokenized=True, limits={**LIMITS, "max_prompt_length": 8})
    assert built.num_truncated == 20 and built.dataset.cache_files  # on disk, memory-mapped
    assert [r["note"] for r in built.dataset] == list(range(20))
    assert max(len(r["prompt_input_ids"]) for r in built.dataset) == 8
    again = _build(dataset, tok, tmp_path / "cache", tokenized=True)  # nothing to cut at these limits
    assert again.dataset is dataset and again.entry.arrow_path is None


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("prepared")
    source = root / "rows.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in _rows(60)), encoding="utf-8")
    out = root / "out"
    argv = ["prepare-data", str(source), "--output", str(out), "--tokenizer", str(bundled_model_dir())]
    argv += ["--train-size", "40", "--eval-size", "10", "--seed", "0", "--max-length", "128", "--max-prompt-length"]
    assert cli_main([*argv, "64", "--disable-tqdm"]) == 0
    return out


def test_a_prepared_split_at_the_run_limits_is_memory_mapped_as_it_is(tmp_path, tok, prepared):
    split = load_prepared(prepared, "train")
    jsonl = [json.loads(line) for line in (prepared / "train.jsonl").read_text().splitlines()]
    assert list(split) == jsonl  # the Arrow rows read back as the JSON lines
    cache = tmp_path / "cache"
    args = cpu_config(tmp_path, max_length=128, max_prompt_length=64, dataset_cache_dir=str(cache))
    trainer = PairDPOTrainer(model=tiny_llama(0, len(tok)), args=args, train_dataset=split, processing_class=tok)
    assert [f["filename"] for f in trainer.train_dataset.cache_files] == [str(prepared / "train.arrow")]
    assert not cache.exists()  # nothing converted
    tighter = cpu_config(tmp_path, max_length=64, max_prompt_length=4, dataset_cache_dir=str(cache))
    trainer = PairDPOTrainer(model=tiny_llama(0, len(tok)), args=tighter, train_dataset=split, processing_class=tok)
    assert Path(trainer.train_dataset.cache_files[0]["filename"]).parent.parent == cache  # cut once, into the cache
    assert max(len(r["prompt_input_ids"]) for r in trainer.train_dataset) == 4
    assert [r["source_row"] for r in trainer.train_dataset] == [r["source_row"] for r in jsonl]


def test_a_prepared_pair_over_the_budget_is_refused_with_its_index(tmp_path, tok, prepared):
    split = load_prepared(prepared, "train")
    costs = pair_cost_array(split.rows, share_prompt=True)  # the tiny Llama packs the shared-prompt layout
    budget = int(costs.max()) - 1  # the costliest pairs are over it
    args = cpu_config(
        tmp_path, max_length=128, max_prompt_length=64, max_tokens_per_microbatch=budget, gradient_accumulation_steps=1
    )
    with pytest.raises(PreferenceRowError) as info:
        PairDPOTrainer(model=tiny_llama(0, len(tok)), args=args, train_dataset=split, processing_class=tok)
    assert info.value.reason_code == "pair_too_long"
    assert f"train dataset row {int(np.flatnonzero(costs > budget)[0])}:" in info.value.message


def test_the_fingerprint_of_memory_mapped_pairs_equals_that_of_the_lists(tmp_path, tok):
    built = _build(_rows(50), tok, tmp_path / "cache")
    lists = [{c: r[c] for c in FEATURE_COLUMNS} for r in built.dataset]
    assert dataset_fingerprint(built.dataset) == dataset_fingerprint(lists)


def _rss_file_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssFile in /proc/self/status")


@pytest.mark.integration
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/self/status (Linux)")
def test_the_rows_fingerprint_of_a_large_memory_mapped_dataset_is_read_by_a_child(tmp_path, monkeypatch):
    from pair_dpo_trainer.data import arrow

    path = tmp_path / "raw.arrow"
    schema = pa.schema([("prompt", pa.string())])
    batch = pa.RecordBatch.from_pylist([{"prompt": "7 " * 5000}] * 1000, schema=schema)
    arrow.write_stream(path, schema, [batch] * 20)  # 200 MB
    dataset = arrow.open_arrow(path)
    monkeypatch.setattr(arrow, "CHILD_HASH_BYTES", 1 << 20)
    before = _rss_file_mib()
    in_child = arrow.content_fingerprint(dataset)
    after_child = _rss_file_mib()
    inline = arrow._content_fingerprint(dataset)
    after_inline = _rss_file_mib()
    assert in_child == inline
    assert after_child - before < 50 < after_inline - after_child  # the pages were read in the child


# ------------------------------------------------------------------------------------------------ streamed inputs


def test_a_jsonl_input_is_read_in_bounded_chunks(tmp_path):
    path = tmp_path / "big.jsonl"
    row = {"prompt": "p " * 500, "chosen": "c", "rejected": "r"}
    with open(path, "w", encoding="utf-8") as f:
        for i in range(20_000):
            f.write(json.dumps({**row, "chosen": str(i)}) + "\n")
    size = path.stat().st_size
    stream = FileStream(str(path))
    tracemalloc.start()
    try:
        sizes = [len(chunk.payload.lines) for chunk in stream.chunks()]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert size > 20_000_000 and stream.rows == 20_000 and max(sizes) == CHUNK_ROWS
    assert peak < size / 10  # a whole-file read would hold the file at least once
    assert stream.sha256 == _sha(path)


def test_a_parquet_input_is_read_by_batches_with_the_same_verdicts(tmp_path):
    texts = [b"sort ascending: 2 1", b"sort ascending: 3 \xed\xa0\x80 1", b"sort ascending: 5 4"]
    valid = pa.array(texts, type=pa.binary())
    prompts = pa.Array.from_buffers(pa.string(), len(texts), valid.buffers())  # invalid UTF-8 in row 2
    table = pa.table({"prompt": prompts, "chosen": ["1 2", "1 3", "4 5"], "rejected": ["2 1", "3 1", "5 4"]})
    pq.write_table(table, tmp_path / "rows.parquet")
    out = tmp_path / "out"
    argv = ["prepare-data", str(tmp_path / "rows.parquet"), "--output", str(out), "--tokenizer"]
    argv += [str(bundled_model_dir()), "--train-size", "1", "--eval-size", "1", "--seed", "0", "--disable-tqdm"]
    assert cli_main(argv) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["rejections"] == {"bad_text": 1} and manifest["inputs"][0]["rows"] == 3


def test_a_json_document_and_json_lines_give_the_same_rows(tmp_path):
    rows = _rows(5)
    document, lines = tmp_path / "a.json", tmp_path / "b.json"
    document.write_text(json.dumps(rows, indent=1))  # one pretty-printed array
    lines.write_text("".join(json.dumps(r) + "\n" for r in rows))  # JSON lines under a .json name
    for path in (document, lines):
        stream = FileStream(str(path))
        from pair_dpo_trainer.data.streams import chunk_rows

        assert [r for chunk in stream.chunks() for r in chunk_rows(chunk.payload)] == rows


# ------------------------------------------------------------------------------------------------ snapshot proofs


@pytest.fixture
def snapshot(tmp_path, monkeypatch) -> Path:
    copy_dir = tmp_path / "snapshot"
    shutil.copytree(bundled_model_dir(), copy_dir)
    monkeypatch.setattr(proof_module, "RACY_SECONDS", 0.0)  # the copy is brand new
    return copy_dir


def test_a_matching_proof_spares_the_hashing(snapshot):
    verified, proof = verify_and_prove(snapshot, DEMO_REVISION)
    assert len(proof.files) == len(verified.files) > 3
    checked, hashed = verify_with_proof(snapshot, DEMO_REVISION, proof)
    assert hashed == 0 and checked == verified


def test_a_file_changed_after_the_proof_is_hashed_and_refused(snapshot):
    _, proof = verify_and_prove(snapshot, DEMO_REVISION)
    weights = snapshot / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # same size, one bit
    weights.write_bytes(bytes(data))
    with pytest.raises(SnapshotIntegrityError) as info:
        verify_with_proof(snapshot, DEMO_REVISION, proof)
    assert info.value.reason_code == "hash_mismatch" and info.value.path == "model.safetensors"


def test_a_proof_that_does_not_match_what_the_rank_reads_is_not_trusted(snapshot):
    verified, proof = verify_and_prove(snapshot, DEMO_REVISION)
    forged = proof_module.SnapshotProof(
        proof.root,
        proof.revision,
        proof.manifest_digest,
        tuple(proof_module.ProvenFile(f.rel, f.path, f.kind, "0" * len(f.digest), f.stamp) for f in proof.files),
    )
    other_revision = proof_module.SnapshotProof(proof.root, "1" * 40, proof.manifest_digest, proof.files)
    for bad in (forged, other_revision, None):
        checked, hashed = verify_with_proof(snapshot, DEMO_REVISION, bad)
        assert hashed == len(verified.files) and checked == verified


def test_files_changed_just_before_the_proof_are_left_out(snapshot, monkeypatch):
    monkeypatch.setattr(proof_module, "RACY_SECONDS", 3600.0)
    verified, proof = verify_and_prove(snapshot, DEMO_REVISION)
    assert proof.files == () and verify_with_proof(snapshot, DEMO_REVISION, proof)[1] == len(verified.files)


def test_the_pairs_are_int32_arrow_columns_read_row_by_row(tmp_path, tok):
    """The trainer's pairs are Arrow columns: a row is read through the memory map, not held as lists of ints."""
    built = _build(_rows(30), tok, tmp_path / "cache")
    table = built.dataset.data
    assert all(table.schema.field(c).type == pa.list_(pa.int32()) for c in FEATURE_COLUMNS)
    index = random.Random(0).randrange(30)
    assert (
        built.dataset[index]["prompt_input_ids"]
        == tokenize_dataset([_rows(30)[index]], tok, **LIMITS, strict=True).features[0]["prompt_input_ids"]
    )


# ------------------------------------------------------------------------------------------------ once per node


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=datetime.timedelta(seconds=30))


@pytest.mark.integration
def test_a_slow_local_main_is_waited_for_as_long_as_it_beats(store, monkeypatch):
    """A beat every 0.05 s and a stall window of 20 beats (stretched on a loaded machine): the waiter outlasts more
    than two windows only because the beats keep coming. A window of a few beats was red on a machine running two CPU
    hogs beside the suite (one beat can wait a scheduler slice there)."""
    from pair_dpo_trainer.parallel import node

    monkeypatch.setattr(node, "HEARTBEAT_SECONDS", 0.05)
    stall_timeout = scaled(1.0)

    def slow_work():
        time.sleep(2.5 * stall_timeout)
        return "tokenised"

    def local_main():
        outcome, _ = node._run_with_heartbeat(slow_work, store, "once/0/beat")
        store.set("once/0/done", pickle.dumps(outcome))

    thread = threading.Thread(target=local_main)
    thread.start()
    node._wait_for(store, "once/0", 0, stall_timeout=stall_timeout)  # returns: the heartbeat kept coming
    thread.join()
    assert pickle.loads(store.get("once/0/done")) == (True, "tokenised")


def test_a_local_main_without_heartbeat_is_a_stall(store, monkeypatch):
    from pair_dpo_trainer.parallel import node

    monkeypatch.setattr(node, "HEARTBEAT_SECONDS", 0.1)
    store.set("once/1/beat", "0")  # it started, then nothing more
    with pytest.raises(node.ScheduleError) as info:
        node._wait_for(store, "once/1", 3, stall_timeout=0.5)
    assert info.value.reason_code == "local_main_stalled" and "ddp_timeout" in info.value.message
