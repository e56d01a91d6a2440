"""`pair-dpo pin DIR`: a local save_pretrained directory becomes a verifiable reference (Hub local-dir format)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from huggingface_hub._local_folder import read_download_metadata
from transformers import AutoModelForCausalLM, AutoTokenizer

from pair_dpo_trainer import ConfigError, PairDPOTrainer, SnapshotIntegrityError
from pair_dpo_trainer.demo import bundled_model_dir, bundled_pairs_path
from pair_dpo_trainer.integrity import pin_snapshot, read_identity, verify_snapshot
from pair_dpo_trainer.integrity.pin import LFS_SIZE_LIMIT, digest_kind
from tests.dpo_fixtures import cpu_config

PAIRS = [json.loads(line) for line in open(bundled_pairs_path(), encoding="utf-8").readlines()[:32]]
HEX = set("0123456789abcdef")


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory) -> Path:
    """What an SFT run leaves: save_pretrained of a (changed) model and its tokenizer, no download metadata."""
    out = tmp_path_factory.mktemp("sft") / "my-sft"
    model = AutoModelForCausalLM.from_pretrained(bundled_model_dir())
    with torch.no_grad():
        model.lm_head.weight.mul_(1.01)  # "fine-tuned": not the bundled snapshot's bytes
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(bundled_model_dir()).save_pretrained(out)
    return out


def _copy(sft_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(sft_dir, target)
    return target


def _pin_cli(path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["pair-dpo", "pin", str(path), *extra], capture_output=True, text=True, timeout=120)


def test_pin_writes_metadata_that_huggingface_hub_and_verify_snapshot_accept(sft_dir, tmp_path):
    model_dir = _copy(sft_dir, tmp_path)
    assert not (model_dir / ".cache").exists()
    done = _pin_cli(model_dir, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    revision = json.loads(done.stdout)["revision"]
    assert len(revision) == 40 and set(revision) <= HEX
    payload = sorted(p.relative_to(model_dir).as_posix() for p in model_dir.rglob("*") if ".cache" not in p.parts)
    assert "model.safetensors" in payload and "config.json" in payload
    for rel in payload:
        data = (model_dir / rel).read_bytes()
        # etags computed independently: SHA-256 for the LFS weights, Git blob SHA-1 for text files (as on the Hub).
        expected = hashlib.sha256(data).hexdigest() if rel.endswith(".safetensors") else _git_blob_sha1(data)
        record = read_download_metadata(model_dir, rel)  # huggingface_hub's own reader (None if it rejects it)
        assert record is not None, rel
        assert (record.commit_hash, record.etag) == (revision, expected), rel
    assert (model_dir / ".cache/huggingface/.gitignore").read_text() == "*"
    assert (model_dir / ".cache/huggingface/CACHEDIR.TAG").read_text().startswith("Signature: 8a477f597d28d172789f")
    snapshot = verify_snapshot(model_dir, revision)
    assert snapshot.revision == revision and {f.path for f in snapshot.files} == set(payload)


def test_revision_is_derived_from_the_contents(sft_dir, tmp_path):
    first = pin_snapshot(_copy(sft_dir, tmp_path / "a"))
    second = pin_snapshot(_copy(sft_dir, tmp_path / "b"))
    assert first.revision == second.revision and first.manifest_digest == second.manifest_digest
    changed = tmp_path / "b" / "model" / "generation_config.json"
    changed.write_text(changed.read_text().replace("}", ', "temperature": 0.5}', 1))
    again = pin_snapshot(tmp_path / "b" / "model", force=True)
    assert again.revision != first.revision
    verify_snapshot(tmp_path / "b" / "model", again.revision)


def test_sft_save_pretrained_then_pin_then_train_against_the_pinned_revision(sft_dir, tmp_path):
    model_dir = _copy(sft_dir, tmp_path)
    with pytest.raises(ConfigError) as unpinned:
        PairDPOTrainer(model=str(model_dir), args=_config(tmp_path), train_dataset=PAIRS)
    assert unpinned.value.reason_code == "reference_not_pinned" and "pair-dpo pin DIR" in str(unpinned.value)

    done = _pin_cli(model_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    revision = done.stdout.split(" @ ", 1)[1].split()[0]
    assert f"--ref_model_revision {revision}" in done.stdout
    trainer = PairDPOTrainer(
        model=str(model_dir), args=_config(tmp_path, ref_model_revision=revision), train_dataset=PAIRS
    )
    assert trainer.reference_source.pinned and trainer.reference_source.revision == revision
    trainer.train()
    identity = read_identity(tmp_path / "out" / "checkpoint-1")
    assert identity.pinned and identity.revision == revision

    weights = model_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor's bytes, after pinning
    weights.write_bytes(bytes(data))
    with pytest.raises(SnapshotIntegrityError) as changed:
        PairDPOTrainer(model=str(model_dir), args=_config(tmp_path, ref_model_revision=revision), train_dataset=PAIRS)
    assert changed.value.reason_code == "hash_mismatch" and changed.value.path == "model.safetensors"


def _config(tmp_path, **kwargs):
    options = dict(gradient_accumulation_steps=1, max_steps=1, save_strategy="steps", save_steps=1)
    options.update(max_length=128, max_prompt_length=64, allow_unpinned_reference=False, **kwargs)
    return cpu_config(tmp_path, **options)


def test_existing_metadata_is_kept_unless_forced_and_stale_records_go(sft_dir, tmp_path):
    model_dir = _copy(sft_dir, tmp_path)
    first = pin_snapshot(model_dir)
    again = _pin_cli(model_dir)
    assert again.returncode == 1 and "[already_pinned]" in again.stdout and "--force" in again.stdout
    (model_dir / "generation_config.json").unlink()
    forced = pin_snapshot(model_dir, force=True)
    assert forced.revision != first.revision
    assert not (model_dir / ".cache/huggingface/download/generation_config.json.metadata").exists()
    verify_snapshot(model_dir, forced.revision)  # no stale record left: no file_missing


def test_an_incomplete_directory_is_refused_and_nothing_is_written(sft_dir, tmp_path):
    model_dir = _copy(sft_dir, tmp_path)
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(SnapshotIntegrityError) as info:
        pin_snapshot(model_dir)
    assert info.value.reason_code == "no_weights"
    assert not (model_dir / ".cache").exists()


@pytest.mark.parametrize(
    "rel,size,kind",
    [
        ("model.safetensors", 10, "lfs"),
        ("model-00001-of-00002.safetensors", 10, "lfs"),
        ("training_args.bin", 10, "lfs"),
        ("tokenizer.model", 10, "lfs"),
        ("config.json", 10, "git"),
        ("tokenizer.json", LFS_SIZE_LIMIT, "git"),
        ("tokenizer.json", LFS_SIZE_LIMIT + 1, "lfs"),
    ],
)
def test_lfs_files_are_the_ones_the_hub_stores_with_lfs(rel, size, kind):
    assert digest_kind(rel, size) == kind
