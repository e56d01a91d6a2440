"""The trainer's reference gate: verified before loading, identity beside every checkpoint, checked on resume."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save

from pair_dpo_trainer import ConfigError, PairDPOConfig, PairDPOTrainer, SnapshotIntegrityError
from pair_dpo_trainer.atomic import atomic_open
from pair_dpo_trainer.demo import DEMO_REVISION, bundled_model_dir, bundled_pairs_path
from pair_dpo_trainer.integrity import IDENTITY_FILENAME, read_identity, verify_snapshot
from pair_dpo_trainer.training.checks import check_config
from tests.dpo_fixtures import cpu_config
from tools.build_demo_assets import download_metadata_files

PAIRS = [json.loads(line) for line in open(bundled_pairs_path(), encoding="utf-8").readlines()[:48]]


def _config(tmp_path, **kwargs) -> PairDPOConfig:
    """Pinned-reference runs on the bundled model: the unpinned escape hatch is off unless a test turns it on."""
    options = dict(
        gradient_accumulation_steps=1,
        max_steps=2,
        save_strategy="steps",
        save_steps=1,
        max_length=128,
        max_prompt_length=64,
        allow_unpinned_reference=False,
    )
    options.update(kwargs)
    return cpu_config(tmp_path, **options)


def _copy_snapshot(tmp_path, name="snapshot"):
    target = tmp_path / name
    shutil.copytree(bundled_model_dir(), target)
    return target


def _trainer(model_dir, tmp_path, **kwargs) -> PairDPOTrainer:
    config = _config(tmp_path, ref_model_revision=DEMO_REVISION, **kwargs)
    return PairDPOTrainer(model=str(model_dir), args=config, train_dataset=PAIRS)


def _reweight(snapshot_dir, scale: float) -> None:
    """Changes the weights AND rewrites their metadata consistently: verification passes, the manifest changes."""
    path = snapshot_dir / "model.safetensors"
    tensors = load_file(path)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] * scale
    data = save(tensors)
    with atomic_open(path, "wb") as f:  # a new file, not a rewrite in place: another rank may still mmap the old one
        f.write(data)
    for rel, content in download_metadata_files({"model.safetensors": data}, DEMO_REVISION).items():
        if rel.endswith(".metadata"):
            (snapshot_dir / rel).write_bytes(content)


@pytest.mark.integration
def test_pinned_reference_is_verified_and_identity_is_written_beside_every_checkpoint(tmp_path, capsys):
    model_dir = _copy_snapshot(tmp_path)
    trainer = _trainer(model_dir, tmp_path)
    assert trainer.reference_source.pinned
    expected_manifest = verify_snapshot(model_dir, DEMO_REVISION).manifest_digest
    trainer.train()
    assert f"reference online, verified revision {DEMO_REVISION}" in capsys.readouterr().out
    for step in (1, 2):
        identity = read_identity(tmp_path / "out" / f"checkpoint-{step}")
        assert identity.pinned and identity.revision == DEMO_REVISION
        assert identity.manifest_digest == expected_manifest
        assert identity.param_digest and identity.probe_digest
        assert not list((tmp_path / "out" / f"checkpoint-{step}").glob(f".{IDENTITY_FILENAME}*"))  # no temp left


def test_standard_dpo_without_pinned_revision_is_refused(tmp_path):
    with pytest.raises(ConfigError) as info:
        PairDPOTrainer(model=str(bundled_model_dir()), args=_config(tmp_path), train_dataset=PAIRS)
    assert info.value.reason_code == "reference_not_pinned"
    assert "ref_model_revision" in str(info.value) and "allow_unpinned_reference" in str(info.value)


def test_unpinned_reference_allowed_explicitly_records_pinned_false(tmp_path, caplog):
    config = _config(tmp_path, allow_unpinned_reference=True)
    with caplog.at_level(logging.WARNING):
        trainer = PairDPOTrainer(model=str(bundled_model_dir()), args=config, train_dataset=PAIRS)
    assert "allow_unpinned_reference" in caplog.text
    assert trainer.reference_identity.pinned is False and trainer.reference_identity.manifest_digest is None


def test_short_revision_is_refused_before_anything_loads(tmp_path):
    with pytest.raises(ConfigError) as info:
        check_config(_config(tmp_path, ref_model_revision=DEMO_REVISION[:12]))
    assert info.value.reason_code == "revision_not_pinned"


def test_tampered_snapshot_is_rejected_before_any_weight_is_loaded(tmp_path, monkeypatch):
    model_dir = _copy_snapshot(tmp_path)
    weights = model_dir / "model.safetensors"
    stat = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the old mtime is no evidence

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the snapshot was verified")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", no_loading)
    with pytest.raises(SnapshotIntegrityError) as info:
        _trainer(model_dir, tmp_path)
    assert info.value.reason_code == "hash_mismatch" and info.value.path == "model.safetensors"


@pytest.mark.integration
def test_resume_with_a_changed_reference_refuses_to_start(tmp_path):
    model_dir = _copy_snapshot(tmp_path)
    _trainer(model_dir, tmp_path).train()
    _reweight(model_dir, scale=1.5)  # verifies against its (rewritten) metadata, but is another reference
    resumed = _trainer(model_dir, tmp_path, max_steps=3)
    before = {n: p.detach().clone() for n, p in resumed.model.named_parameters()}
    with pytest.raises(SnapshotIntegrityError) as info:
        resumed.train(resume_from_checkpoint=True)
    assert info.value.reason_code == "reference_changed"
    assert "manifest" in str(info.value).lower() or "model.safetensors" in str(info.value)
    assert resumed.state.global_step == 0  # no step ran, no checkpoint state restored
    for name, param in resumed.model.named_parameters():
        torch.testing.assert_close(param, before[name], msg=name)


@pytest.mark.integration
def test_resume_with_probe_drift_only_warns_and_continues(tmp_path, caplog):
    model_dir = _copy_snapshot(tmp_path)
    _trainer(model_dir, tmp_path).train()
    record = tmp_path / "out" / "checkpoint-2" / IDENTITY_FILENAME
    data = json.loads(record.read_text())
    data["probe_digest"] = "0" * 64
    record.write_text(json.dumps(data))
    resumed = _trainer(model_dir, tmp_path, max_steps=3)
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=True)
    assert "environment drift" in caplog.text
    assert resumed.state.global_step == 3


@pytest.mark.integration
def test_resume_from_a_checkpoint_without_identity_is_refused(tmp_path):
    model_dir = _copy_snapshot(tmp_path)
    _trainer(model_dir, tmp_path).train()
    (tmp_path / "out" / "checkpoint-2" / IDENTITY_FILENAME).unlink()
    with pytest.raises(SnapshotIntegrityError) as info:
        _trainer(model_dir, tmp_path, max_steps=3).train(resume_from_checkpoint=True)
    assert info.value.reason_code == "identity_missing"
