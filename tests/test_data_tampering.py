"""Token data that changed on disk is never trained on; token ids outside the model's embedding are refused by row.

A ``prepare-data`` split whose bytes no longer match its manifest's digest stops the run (``bad_manifest``); a
tokenised-pairs cache entry that no longer matches its ``meta.json`` is rebuilt from the rows (the run then logs the
same first step as a clean run); an id outside ``[0, vocab_size)`` is ``bad_token_id`` naming the row. The tampering
keeps each file's size and mtime, so only the bytes tell.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pyarrow as pa
import pytest
from transformers import AutoTokenizer

import pair_dpo_trainer.data.prepared as prepared_module
from pair_dpo_trainer import PairDPOTrainer
from pair_dpo_trainer.cli import main as cli_main
from pair_dpo_trainer.data.dataset import as_pair_dataset
from pair_dpo_trainer.data.prepared import load_prepared
from pair_dpo_trainer.demo import bundled_model_dir, bundled_pairs_path
from pair_dpo_trainer.errors import ConfigError
from pair_dpo_trainer.integrity.hashing import ChunkedSha256, chunked_file_digest
from pair_dpo_trainer.integrity.proof import RACY_SECONDS
from tests.dpo_fixtures import cpu_config
from tests.models import VOCAB, tiny_llama, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
ROWS = 8  # one step of ROWS pairs: every pair is in the first logged step


def _swap_chosen_rejected(path: Path, only_first: bool) -> int:
    """Swaps ``chosen_input_ids`` and ``rejected_input_ids`` of the rows of equal lengths (the first such row only,
    or all), rewriting the Arrow stream with its batches and schema: same size; the mtime is restored. Returns the
    number of rows swapped."""
    before = path.stat()
    with pa.OSFile(str(path)) as source:
        reader = pa.ipc.open_stream(source)
        schema, batches = reader.schema, list(reader)
    table = pa.Table.from_batches(batches, schema=schema)
    chosen, rejected = table["chosen_input_ids"].to_pylist(), table["rejected_input_ids"].to_pylist()
    rows = [i for i, (c, r) in enumerate(zip(chosen, rejected, strict=True)) if len(c) == len(r) and c != r]
    rows = rows[:1] if only_first else rows
    assert rows, f"{path} has no pair of equal lengths to swap"
    for i in rows:
        chosen[i], rejected[i] = rejected[i], chosen[i]
    swapped = table.set_column(
        schema.get_field_index("chosen_input_ids"),
        "chosen_input_ids",
        pa.array(chosen, type=schema.field("chosen_input_ids").type),
    )
    swapped = swapped.set_column(
        schema.get_field_index("rejected_input_ids"),
        "rejected_input_ids",
        pa.array(rejected, type=schema.field("rejected_input_ids").type),
    )
    original = path.read_bytes()
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        start = 0
        for batch in batches:
            writer.write_table(swapped.slice(start, batch.num_rows))
            start += batch.num_rows
    assert path.stat().st_size == before.st_size and path.read_bytes() != original
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_mtime_ns == before.st_mtime_ns
    return len(rows)


def _train(cwd: Path, dataset: Path, cache: Path) -> subprocess.CompletedProcess:
    """One step of ``train.py`` on the bundled tiny model (every pair in it), on CPU."""
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(cwd),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(ROOT),
    }
    argv = ["--model_name_or_path", str(bundled_model_dir()), "--dataset", str(dataset), "--eval_size", "0"]
    argv += ["--use_cpu", "true", "--max_steps", "1", "--logging_steps", "1", "--save_strategy", "no"]
    argv += ["--per_device_train_batch_size", str(ROWS), "--max_length", "64", "--report_to", "none"]
    argv += ["--disable_tqdm", "true", "--dataset_cache_dir", str(cache), "--output_dir", str(cwd / "out")]
    command = [sys.executable, str(ROOT / "train.py"), *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=cwd)


def _first_step(done: subprocess.CompletedProcess) -> dict:
    """The first logged step of a run's output (the Trainer prints its log dicts)."""
    lines = [line for line in done.stdout.splitlines() if line.startswith("{'loss'")]
    assert lines, done.stdout[-2000:] + done.stderr[-4000:]
    return ast.literal_eval(lines[0])


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    lines = bundled_pairs_path().read_text(encoding="utf-8").splitlines()[:ROWS]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, rows_file) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "out"
    argv = ["prepare-data", str(rows_file), "--output", str(out), "--tokenizer", str(bundled_model_dir())]
    assert cli_main([*argv, "--max-length", "64", "--eval-size", "0", "--disable-tqdm"]) == 0
    return out


@pytest.mark.slow
def test_a_prepared_split_changed_on_disk_is_refused_by_the_run(tmp_path, prepared):
    tampered = tmp_path / "prepared"
    tampered.mkdir()
    for name in os.listdir(prepared):
        (tampered / name).write_bytes((prepared / name).read_bytes())
    assert _swap_chosen_rejected(tampered / "train.arrow", only_first=True) == 1
    done = _train(tmp_path, tampered, tmp_path / "cache")
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("train.py: error:")]
    assert errors and errors[0].startswith("train.py: error: [bad_manifest]"), done.stderr[-3000:]
    manifest = json.loads((tampered / "manifest.json").read_text())
    recorded = manifest["outputs"]["train.arrow"]["digest"]["digest"]
    assert str(tampered / "train.arrow") in errors[0] and f"expected {recorded[:16]}" in errors[0]
    assert "run pair-dpo prepare-data again" in errors[0].lower()
    assert "'loss'" not in done.stdout  # no step ran


@pytest.mark.slow
def test_a_cache_entry_changed_on_disk_is_rebuilt_and_the_run_trains_on_the_rows(tmp_path, rows_file):
    cache = tmp_path / "cache"
    (tmp_path / "clean").mkdir()
    clean = _train(tmp_path / "clean", rows_file, cache)  # a fresh cache: the entry is built by this run
    assert clean.returncode == 0, clean.stderr[-3000:]
    (entry,) = [p for p in cache.iterdir() if p.name.startswith("pairs-")]
    built = (entry / "pairs.arrow").read_bytes()
    assert _swap_chosen_rejected(entry / "pairs.arrow", only_first=False) == ROWS
    (tmp_path / "again").mkdir()
    again = _train(tmp_path / "again", rows_file, cache)
    assert again.returncode == 0, again.stderr[-3000:]
    log = again.stdout + again.stderr
    assert f"the tokenised-pairs cache entry at {entry} did not match its recorded digest" in log
    assert "it is removed and rebuilt" in log
    first, expected = _first_step(again), _first_step(clean)
    assert first["logps/chosen"] == expected["logps/chosen"] and first["logps/rejected"] == expected["logps/rejected"]
    assert expected["logps/chosen"] != expected["logps/rejected"]  # the swapped entry would have logged these swapped
    assert (entry / "pairs.arrow").read_bytes() == built  # rebuilt from the rows, where the swapped one was


def _pretokenised(bad_row: int, bad_value: int, column: str = "chosen_input_ids") -> list[dict]:
    rows = [
        {
            "prompt_input_ids": [5 + i, 6, 7],
            "chosen_input_ids": [8, 9 + i, 2],
            "rejected_input_ids": [10, VOCAB - 1, 2],  # the embedding's last row: in range
        }
        for i in range(8)  # one optimizer step of cpu_config
    ]
    rows[bad_row][column] = [*rows[bad_row][column][:1], bad_value, *rows[bad_row][column][2:]]
    return rows


@pytest.mark.parametrize(
    "as_dataset,bad_row,bad_value,column",
    [
        (False, 3, VOCAB, "chosen_input_ids"),
        (True, 4, -1, "prompt_input_ids"),
        (True, 1, VOCAB + 7, "rejected_input_ids"),
    ],
)
def test_a_token_id_outside_the_embedding_is_refused_naming_the_row(tmp_path, as_dataset, bad_row, bad_value, column):
    rows = _pretokenised(bad_row, bad_value, column)
    train = datasets.Dataset.from_list(rows) if as_dataset else rows
    args = cpu_config(tmp_path, max_length=16, max_prompt_length=8, dataset_cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError) as info:
        PairDPOTrainer(model=tiny_llama(0), args=args, train_dataset=train, processing_class=tiny_tokenizer())
    assert info.value.reason_code == "bad_token_id"
    message = info.value.message
    assert message.startswith(f"train dataset row {bad_row}: {column} holds token id {bad_value}, outside [0, {VOCAB})")
    assert "prepare-data" in message and "tokenizer" in message


def test_a_prepared_split_of_a_larger_vocabulary_is_refused_naming_its_first_row_out_of_range(tmp_path, prepared):
    train = load_prepared(prepared, "train")  # the bundled tokenizer's ids; the model embeds only VOCAB of them
    columns = ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids")
    table = pa.ipc.open_stream(pa.OSFile(str(prepared / "train.arrow"))).read_all()
    first = min(
        (row, column, next(v for v in ids if not 0 <= v < VOCAB))
        for column in columns
        for row, ids in enumerate(table[column].to_pylist())
        if any(not 0 <= v < VOCAB for v in ids)
    )
    args = cpu_config(tmp_path, max_length=64, dataset_cache_dir=str(tmp_path / "cache"))
    tokenizer = AutoTokenizer.from_pretrained(bundled_model_dir())
    with pytest.raises(ConfigError) as info:
        PairDPOTrainer(model=tiny_llama(0), args=args, train_dataset=train, processing_class=tokenizer)
    assert info.value.reason_code == "bad_token_id"
    row, column, value = first
    assert info.value.message.startswith(f"train dataset row {row}: {column} holds token id {value}, outside [0, 64)")


def test_token_ids_within_the_embedding_are_accepted(tmp_path):
    rows = _pretokenised(0, VOCAB - 1)
    args = cpu_config(tmp_path, max_length=16, max_prompt_length=8, dataset_cache_dir=str(tmp_path / "cache"))
    trainer = PairDPOTrainer(model=tiny_llama(0), args=args, train_dataset=rows, processing_class=tiny_tokenizer())
    assert len(trainer.train_dataset) == len(rows)


def _independent_chunked(data: bytes, chunk_bytes: int) -> str:
    """The chunked digest by its definition (``integrity.hashing.CHUNKED_FORMAT``), written out with hashlib."""
    pieces = [data[i : i + chunk_bytes] for i in range(0, len(data), chunk_bytes)] or [b""]
    header = f"pair_dpo_trainer.sha256-chunks/1 {chunk_bytes} {len(data)}\n".encode()
    return hashlib.sha256(header + b"".join(hashlib.sha256(p).digest() for p in pieces)).hexdigest()


@pytest.mark.parametrize("size", [0, 1, 999, 1000, 1001, 3500])
def test_the_chunked_digest_is_the_hash_of_the_piece_hashes(tmp_path, size):
    data = os.urandom(size)
    hasher = ChunkedSha256(chunk_bytes=1000)
    for start in range(0, size, 337):  # written in pieces that straddle the digest's pieces
        hasher.update(data[start : start + 337])
    expected = _independent_chunked(data, 1000)
    assert hasher.hexdigest() == expected and hasher.record()["digest"] == expected
    path = tmp_path / "file"
    path.write_bytes(data)
    for threads in (1, 3):
        assert chunked_file_digest(path, chunk_bytes=1000, threads=threads) == (expected, size)


def test_the_manifest_records_the_chunked_digest_of_each_arrow_split(prepared):
    manifest = json.loads((prepared / "manifest.json").read_text())
    for name in ("train.arrow", "eval.arrow"):
        record = manifest["outputs"][name]["digest"]
        assert record["format"] == "pair_dpo_trainer.sha256-chunks/1"
        assert record["digest"] == _independent_chunked((prepared / name).read_bytes(), record["chunk_bytes"])


def _settled(path: Path) -> None:
    """Waits until ``path`` last changed long enough ago for a proof of it to count (``integrity.proof``)."""
    st = path.stat()
    time.sleep(max(0.0, max(st.st_mtime_ns, st.st_ctime_ns) / 1e9 + RACY_SECONDS + 0.1 - time.time()))


@pytest.mark.integration
def test_the_nodes_other_ranks_take_the_local_mains_proof_unless_the_file_changed(tmp_path, prepared, monkeypatch):
    hashed = []
    real = prepared_module.digest_per_record
    monkeypatch.setattr(
        prepared_module, "digest_per_record", lambda path, record: hashed.append(path) or real(path, record)
    )
    copy = tmp_path / "prepared"
    copy.mkdir()
    for name in os.listdir(prepared):
        (copy / name).write_bytes((prepared / name).read_bytes())
    _settled(copy / "train.arrow")
    split = load_prepared(copy, "train")
    proof = split.verify()  # the local main's hashing
    assert proof.stamp is not None and len(hashed) == 1
    assert split.verify(proof) is proof and len(hashed) == 1  # another rank of the node: not hashed again

    def other_rank(work):  # what Node.once gives a rank that is not its node's local main
        return proof, False

    limits = dict(max_length=64, max_prompt_length=32, max_tokens_per_microbatch=None)
    tokenizer = AutoTokenizer.from_pretrained(bundled_model_dir())
    as_pair_dataset(split, tokenizer, **limits, once=other_rank, cache_dir=str(tmp_path / "cache"))
    assert len(hashed) == 1
    _swap_chosen_rejected(copy / "train.arrow", only_first=True)  # after the proof: its stamp (ctime) changed
    with pytest.raises(ConfigError) as info:
        as_pair_dataset(split, tokenizer, **limits, once=other_rank, cache_dir=str(tmp_path / "cache"))
    assert info.value.reason_code == "bad_manifest" and len(hashed) == 2  # hashed by this rank, and refused


def test_the_pairs_digest_ranks_compare_is_the_recorded_one_and_tells_swapped_labels_apart(tmp_path, prepared):
    """Ranks compare :func:`pairs_digest` before the first step: read from a cache entry's key or a prepared split's
    manifest, not recomputed, and different for rows whose every pair costs the same (chosen and rejected swapped)."""
    from pair_dpo_trainer.data.dataset import pairs_digest
    from pair_dpo_trainer.data.readers import iter_rows, load_rows

    tokenizer = AutoTokenizer.from_pretrained(bundled_model_dir())
    limits = dict(max_length=64, max_prompt_length=32, max_tokens_per_microbatch=None)
    rows = list(iter_rows(load_rows(str(bundled_pairs_path()), str(tmp_path / "datasets"))))[:16]
    swapped = [{**row, "chosen": row["rejected"], "rejected": row["chosen"]} for row in rows]
    digests = {}
    for name, data, cache in (("a", rows, "c1"), ("b", rows, "c2"), ("swapped", swapped, "c1")):
        pairs = as_pair_dataset(data, tokenizer, **limits, cache_dir=str(tmp_path / cache))
        digests[name] = pairs_digest(pairs)
    assert digests["a"] == digests["b"] and digests["a"] != digests["swapped"]  # another node's cache: same digest
    assert digests["a"].startswith("cache entry ")
    split = load_prepared(prepared, "train")
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert pairs_digest(split.rows) == f"prepared split {manifest['outputs']['train.arrow']['digest']['digest']}"
