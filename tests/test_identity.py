"""Reference identity record: digests, atomic write/read round trip and comparison."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from huggingface_hub._local_folder import get_local_download_paths, write_download_metadata
from safetensors.torch import save_file

from pair_dpo_trainer.errors import SnapshotIntegrityError
from pair_dpo_trainer.integrity import (
    IDENTITY_FILENAME,
    ReferenceIdentity,
    assert_same_reference,
    build_identity,
    compare_identity,
    parameter_digest,
    probe_digest,
    read_identity,
    verify_snapshot,
    write_identity,
)

REVISION = hashlib.sha1(b"identity test revision").hexdigest()


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2, bias=False))


def identity(**changes: object) -> ReferenceIdentity:
    base = ReferenceIdentity(
        repo_id="org/tiny",
        revision=REVISION,
        pinned=True,
        manifest_digest="a" * 64,
        files={"config.json": "b" * 40, "model.safetensors": "c" * 64},
        param_digest="d" * 64,
        probe_digest="e" * 64,
        versions={"torch": "2.13.0", "pair_dpo_trainer": "0.1.0"},
        device="cpu (x86_64)",
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_parameter_digest_is_order_independent_and_sensitive_to_one_element() -> None:
    model = tiny_model()
    digest = parameter_digest(model.named_parameters())
    assert digest == parameter_digest(reversed(list(model.named_parameters())))
    original = model[0].weight.detach().clone()
    with torch.no_grad():
        model[0].weight[1, 2] = torch.nextafter(model[0].weight[1, 2], torch.tensor(1.0))  # one ulp
    assert parameter_digest(model.named_parameters()) != digest
    with torch.no_grad():
        model[0].weight.copy_(original)
    assert parameter_digest(model.named_parameters()) == digest


def test_parameter_digest_covers_name_dtype_and_shape() -> None:
    t = torch.arange(6, dtype=torch.float32)
    base = parameter_digest([("w", t)])
    assert parameter_digest([("v", t)]) != base
    assert parameter_digest([("w", t.view(2, 3))]) != base
    assert parameter_digest([("w", t.view(torch.int32))]) != base  # same bytes, other dtype
    assert parameter_digest([("w", t.to(torch.bfloat16))]) != base
    assert parameter_digest([("w", t.view(2, 3).t())]) == parameter_digest([("w", t.view(2, 3).t().contiguous())])
    with pytest.raises(ValueError):
        parameter_digest([("w", t), ("w", t)])
    with pytest.raises(ValueError):
        parameter_digest([("w", torch.empty(3, device="meta"))])


def test_probe_digest_rounding() -> None:
    logps = torch.tensor([-12.3451, -40.0, 0.0], dtype=torch.float32)
    digest = probe_digest(logps)
    assert probe_digest(logps + 1e-5) == digest  # below the documented precision
    assert probe_digest(logps - torch.tensor([0.0, 0.01, 0.0])) != digest
    assert probe_digest(torch.tensor([-0.0001])) == probe_digest(torch.tensor([0.0]))
    assert probe_digest(logps.view(3, 1)) != digest


def test_write_read_round_trip_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record = identity()
    path = write_identity(tmp_path, record)
    assert path == tmp_path / IDENTITY_FILENAME
    assert os.listdir(tmp_path) == [IDENTITY_FILENAME]
    text = path.read_text()
    assert text == json.dumps(json.loads(text), sort_keys=True, indent=2) + "\n"
    assert read_identity(tmp_path) == record

    def boom(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        write_identity(tmp_path, identity(param_digest="f" * 64))
    assert os.listdir(tmp_path) == [IDENTITY_FILENAME]  # no temp file left, old record intact
    assert read_identity(tmp_path) == record


def test_read_identity_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_identity(tmp_path)
    for text in ("{not json", json.dumps({"format": 99}), json.dumps({"format": 1, "bogus": 1})):
        (tmp_path / IDENTITY_FILENAME).write_text(text)
        with pytest.raises(SnapshotIntegrityError) as info:
            read_identity(tmp_path)
        assert info.value.reason_code == "identity_malformed"


def test_compare_identity() -> None:
    same = compare_identity(identity(), identity())
    assert same.reason_code is None and not same.reference_changed
    assert assert_same_reference(identity(), identity()).reason_code is None

    files = {"config.json": "b" * 40, "model.safetensors": "0" * 64}
    manifest = compare_identity(identity(), identity(manifest_digest="0" * 64, files=files))
    assert manifest.manifest_differs and manifest.changed_files == ("model.safetensors",)
    params = compare_identity(identity(), identity(param_digest="0" * 64))
    assert params.params_differs and not params.manifest_differs and params.reason_code == "reference_changed"
    for actual, word in (
        (identity(manifest_digest="0" * 64), "manifest"),
        (identity(param_digest="0"), "param"),
    ):
        with pytest.raises(SnapshotIntegrityError) as info:
            assert_same_reference(identity(), actual)
        assert info.value.reason_code == "reference_changed" and word in info.value.message

    drift = assert_same_reference(identity(), identity(probe_digest="0" * 64, device="NVIDIA H200"))
    assert drift.reason_code == "environment_drift" and drift.probe_differs and not drift.reference_changed
    assert "not corruption" in drift.describe() and drift.version_changes["device"][1] == "NVIDIA H200"

    unknown = compare_identity(identity(), identity(param_digest=None, probe_digest=None))
    assert unknown.reason_code is None and unknown.not_compared == ("params", "probe")
    unpinned = compare_identity(identity(), identity(pinned=False, manifest_digest=None, files={}))
    assert unpinned.reason_code == "reference_changed"


def test_build_identity_from_verified_snapshot(tmp_path: Path) -> None:
    for rel, data in (("config.json", b"{}"), ("model.safetensors", None)):
        paths = get_local_download_paths(tmp_path, rel)
        if data is None:
            save_file({"w": torch.ones(2, 2)}, paths.file_path)
            etag = hashlib.sha256(paths.file_path.read_bytes()).hexdigest()
        else:
            paths.file_path.write_bytes(data)
            etag = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        write_download_metadata(tmp_path, rel, REVISION, etag)
    snapshot = verify_snapshot(tmp_path, REVISION)
    model = tiny_model()
    record = build_identity(
        snapshot=snapshot,
        repo_id="org/tiny",
        named_parameters=model.named_parameters(),
        probe_logps=torch.zeros(4),
    )
    assert record.pinned and record.revision == REVISION and record.manifest_digest == snapshot.manifest_digest
    assert record.files == snapshot.digests and record.param_digest == parameter_digest(model.named_parameters())
    assert {"torch", "pair_dpo_trainer", "python"} <= set(record.versions) and record.device
    checkpoint = tmp_path / "checkpoint-1"
    checkpoint.mkdir()
    write_identity(checkpoint, record)
    assert read_identity(checkpoint) == record
    unpinned = build_identity(revision="main")
    assert not unpinned.pinned and unpinned.manifest_digest is None


def test_a_reference_whose_weights_changed_is_not_called_environment_drift() -> None:
    """The identities of a real reference before and after its weights changed differ in both the parameter and the
    probe digest: ``reference_changed``, and the message does not excuse the probe as a GPU or driver difference."""
    from pair_dpo_trainer.modeling.attention import enable_pair_varlen
    from pair_dpo_trainer.reference.base import FrozenReference
    from pair_dpo_trainer.reference.gate import compute_identity
    from pair_dpo_trainer.reference.source import ReferenceSource
    from tests.models import VOCAB, tiny_llama

    source = ReferenceSource(directory=None, snapshot=None, revision=None, repo_id=None)
    model = tiny_llama(0)
    enable_pair_varlen(model)
    recorded = compute_identity(source, FrozenReference(model, chunk_size=64), vocab_size=VOCAB, device="cpu")
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)  # the weights changed after the checkpoint recorded them
    current = compute_identity(source, FrozenReference(model, chunk_size=64), vocab_size=VOCAB, device="cpu")
    with pytest.raises(SnapshotIntegrityError) as changed:
        assert_same_reference(recorded, current)
    message = changed.value.message
    assert changed.value.reason_code == "reference_changed" and "parameter digest differs" in message
    assert "probe log-prob digest differs" in message and "not corruption" not in message
