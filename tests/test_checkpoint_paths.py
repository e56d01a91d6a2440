"""A hostile checkpoint directory: paths that lead a loader outside what was scanned, special files, aliased names.

Every case is a real directory on disk with the real fault in it (an absolute or ``..`` DeepSpeed tag, a symlinked
``global_stepN``, a FIFO, a manifest naming one file twice, a DCP ``.metadata`` with code), checked in process through
the scan that resume runs (``checkpoint_verdict``). A real 2-rank resume with a FIFO shows that every rank gets the
reason code instead of hanging; the real DeepSpeed resume of a tag that escapes is in tests/test_checkpoint_tampering.py
(it shares that module's ZeRO-3 run). DeepSpeed's own ``load_checkpoint`` shows that the tag it loads is the scanned
one even when ``latest`` changes after the scan.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import threading
from pathlib import Path

import pytest
import torch

from pair_dpo_trainer.data.cache import META_FILE, PairCache
from pair_dpo_trainer.errors import CheckpointError
from pair_dpo_trainer.fault_tolerance.checkpoint import MANIFEST_FILENAME, MANIFEST_MAX_BYTES, read_manifest
from pair_dpo_trainer.fault_tolerance.checkpoint_trust import checkpoint_verdict, deepspeed_loads_tag
from pair_dpo_trainer.fault_tolerance.resume import resolve_resume
from pair_dpo_trainer.integrity.hashing import hash_file
from tests.faults import logs, outcome, run_spec, run_to_end

MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"


class Payload:
    """Unpickled, it runs ``exec``: writes ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def _deepspeed_checkpoint(root: Path, *, manifest: bool) -> Path:
    """A checkpoint laid out as DeepSpeed's: ``latest`` naming ``global_step2`` with harmless pickles."""
    checkpoint = root / "checkpoint-2"
    (checkpoint / "global_step2").mkdir(parents=True)
    torch.save({"module": {"w": torch.ones(2)}}, checkpoint / "global_step2" / MODEL_STATES)
    torch.save({"step": torch.tensor(2)}, checkpoint / "rng_state.pth")
    (checkpoint / "latest").write_text("global_step2")
    if manifest:
        _write_manifest(checkpoint)
    return checkpoint


def _write_manifest(checkpoint: Path, names: dict[str, str] | None = None) -> None:
    """A manifest of every file (or of ``names``: listed name -> file), with sizes and SHA-256, as a save writes."""
    files = names or {
        str(p.relative_to(checkpoint)): str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file()
    }
    files.pop(MANIFEST_FILENAME, None)
    data = {
        "format": 2,
        "files": {name: (checkpoint / real).stat().st_size for name, real in files.items()},
        "sha256": {name: hashlib.sha256((checkpoint / real).read_bytes()).hexdigest() for name, real in files.items()},
    }
    (checkpoint / MANIFEST_FILENAME).write_text(json.dumps(data))


def _forged_tag_dir(root: Path, marker: Path) -> Path:
    """A directory outside the checkpoint holding DeepSpeed's model-states name with code in it."""
    evil = root / "elsewhere" / "global_step9"
    evil.mkdir(parents=True)
    torch.save(Payload(marker), evil / MODEL_STATES)
    return evil


def _refused(checkpoint: Path, code: str, *words: str) -> str:
    verdict = checkpoint_verdict(checkpoint)
    assert verdict is not None and verdict[0] == code, verdict
    for word in words:
        assert word in verdict[1], verdict
    return verdict[1]


def test_a_deepspeed_layout_passes_with_or_without_its_manifest(tmp_path):
    for manifest in (True, False):
        checkpoint = _deepspeed_checkpoint(tmp_path / str(manifest), manifest=manifest)
        assert checkpoint_verdict(checkpoint) is None


@pytest.mark.parametrize("tag", ["absolute", "dotdot"])
def test_a_manifest_less_tag_outside_the_checkpoint_is_refused(tmp_path, tag):
    marker = tmp_path / "payload-ran"
    checkpoint = _deepspeed_checkpoint(tmp_path, manifest=False)
    evil = _forged_tag_dir(tmp_path, marker)
    (checkpoint / "latest").write_text(str(evil) if tag == "absolute" else "../elsewhere/global_step9")
    _refused(checkpoint, "checkpoint_unsafe_path", "latest", "not one plain directory name")
    assert not marker.exists()


def test_a_global_step_directory_replaced_by_a_symlink_is_refused(tmp_path):
    marker = tmp_path / "payload-ran"
    checkpoint = _deepspeed_checkpoint(tmp_path, manifest=False)
    evil = _forged_tag_dir(tmp_path, marker)
    for path in (checkpoint / "global_step2").iterdir():
        path.unlink()
    (checkpoint / "global_step2").rmdir()
    (checkpoint / "global_step2").symlink_to(evil, target_is_directory=True)
    _refused(checkpoint, "checkpoint_unsafe_path", "global_step2 is a symbolic link", str(evil))


def test_a_manifest_with_only_latest_rehashed_to_a_tag_outside_is_refused(tmp_path):
    checkpoint = _deepspeed_checkpoint(tmp_path, manifest=True)
    evil = _forged_tag_dir(tmp_path, tmp_path / "payload-ran")
    (checkpoint / "latest").write_text(f"{evil}\n")
    manifest = json.loads((checkpoint / MANIFEST_FILENAME).read_text())
    manifest["files"]["latest"] = (checkpoint / "latest").stat().st_size
    manifest["sha256"]["latest"] = hashlib.sha256((checkpoint / "latest").read_bytes()).hexdigest()
    (checkpoint / MANIFEST_FILENAME).write_text(json.dumps(manifest))
    _refused(checkpoint, "checkpoint_unsafe_path", "latest")


def test_a_tag_with_glob_characters_or_naming_no_directory_is_refused(tmp_path):
    checkpoint = _deepspeed_checkpoint(tmp_path, manifest=False)
    (checkpoint / "latest").write_text("global_step*")  # DeepSpeed globs <checkpoint>/<tag>/...: any directory
    _refused(checkpoint, "checkpoint_unsafe_path", "global_step*")
    (checkpoint / "latest").write_text("global_step7")
    _refused(checkpoint, "checkpoint_incomplete", "global_step7")
    (checkpoint / "latest").unlink()
    _refused(checkpoint, "checkpoint_incomplete", "no latest")


def test_a_weight_index_naming_a_shard_outside_the_checkpoint_is_refused(tmp_path):
    checkpoint = _deepspeed_checkpoint(tmp_path, manifest=False)
    index = {"weight_map": {"w": "../elsewhere/pytorch_model-00001.bin"}}
    (checkpoint / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    _refused(checkpoint, "checkpoint_unsafe_path", "pytorch_model.bin.index.json", "../elsewhere")


def _finishes(function, *args, timeout: float = 20.0):
    """``function(*args)`` in a thread: what it returned or raised; fails (instead of hanging the test) when it has not
    returned in ``timeout``."""
    result: list = []

    def call() -> None:
        try:
            result.append(function(*args))
        except Exception as exc:  # noqa: BLE001 - returned, for the test to judge
            result.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{function.__name__} still blocked after {timeout} s"
    return result[0]


@pytest.fixture
def fifo_release():
    """Opens every FIFO left in the list for writing afterwards, so a reader blocked on it (a failing test) ends."""
    fifos: list[Path] = []
    yield fifos
    for fifo in fifos:
        try:
            os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))  # never blocks; wakes a reader blocked in open()
        except OSError:
            pass


@pytest.mark.parametrize("where", ["rng_state.pth", "global_step2/" + MODEL_STATES, MANIFEST_FILENAME, "latest"])
def test_a_fifo_anywhere_in_a_checkpoint_is_refused_without_blocking(tmp_path, fifo_release, where):
    checkpoint = _deepspeed_checkpoint(tmp_path, manifest=where != MANIFEST_FILENAME)
    fifo = checkpoint / where
    fifo.unlink(missing_ok=True)
    os.mkfifo(fifo)
    fifo_release.append(fifo)
    resolved = _finishes(resolve_resume, str(checkpoint), str(tmp_path), timeout=10)  # what every rank runs
    assert resolved == str(checkpoint) or getattr(resolved, "reason_code", None) == "checkpoint_incomplete", resolved
    verdict = _finishes(checkpoint_verdict, checkpoint)
    assert verdict is not None and verdict[0] == "checkpoint_special_file" and where in verdict[1], verdict
    assert "FIFO" in verdict[1]


def test_snapshot_cache_and_manifest_readers_refuse_a_fifo_without_blocking(tmp_path, fifo_release):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    fifo_release.append(fifo)

    def hashed():
        with pytest.raises(OSError, match="FIFO"):
            hash_file(fifo, "lfs")

    _finishes(hashed)
    os.mkfifo(tmp_path / MANIFEST_FILENAME)
    fifo_release.append(tmp_path / MANIFEST_FILENAME)
    assert _finishes(read_manifest, tmp_path) is None
    cache, key = PairCache(tmp_path / "cache"), {"rows": "digest"}
    cache.entry_dir(key).mkdir(parents=True)
    os.mkfifo(cache.entry_dir(key) / META_FILE)
    fifo_release.append(cache.entry_dir(key) / META_FILE)
    assert _finishes(cache.lookup, key) is None  # no entry, not a hang


def test_aliased_or_duplicate_manifest_names_are_refused_and_names_are_normalised(tmp_path):
    checkpoint = _deepspeed_checkpoint(tmp_path, manifest=False)
    files = ["rng_state.pth", "latest", "global_step2/" + MODEL_STATES]
    _write_manifest(checkpoint, {**{name: name for name in files}, "./rng_state.pth": "rng_state.pth"})
    _refused(checkpoint, "checkpoint_tampered", "'rng_state.pth' twice")  # one file listed (and hashed) twice
    _write_manifest(checkpoint, {"rng_state.pth": "rng_state.pth", "././latest": "latest", files[2]: files[2]})
    assert checkpoint_verdict(checkpoint) is None  # ././latest is latest, listed once
    assert set(read_manifest(checkpoint)["files"]) == set(files)
    text = (checkpoint / MANIFEST_FILENAME).read_text()
    duplicated = text.replace('"files": {', '"files": {"rng_state.pth": 1, ', 1)  # the same JSON key twice
    (checkpoint / MANIFEST_FILENAME).write_text(duplicated)
    _refused(checkpoint, "checkpoint_tampered", "'rng_state.pth' is given twice")


def test_an_oversized_manifest_is_refused_unread(tmp_path):
    checkpoint = _deepspeed_checkpoint(tmp_path, manifest=True)
    manifest = json.loads((checkpoint / MANIFEST_FILENAME).read_text())
    manifest["padding"] = "x" * MANIFEST_MAX_BYTES
    (checkpoint / MANIFEST_FILENAME).write_text(json.dumps(manifest))
    _refused(checkpoint, "checkpoint_tampered", f"larger than {MANIFEST_MAX_BYTES} bytes")


# ------------------------------------------------------------------------------------------------ FSDP2 / DCP
def _dcp_checkpoint(root: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    checkpoint = root / "checkpoint-2"
    state = {"model": {"w": torch.randn(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)}, "step": 3}
    dcp.save(state, checkpoint_id=checkpoint / "pytorch_model_fsdp_0", no_dist=True)
    torch.save({"step": torch.tensor(2)}, checkpoint / "rng_state.pth")
    return checkpoint


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process
def test_a_dcp_metadata_pickle_with_code_or_a_shard_outside_is_refused(tmp_path):
    marker = tmp_path / "payload-ran"
    checkpoint = _dcp_checkpoint(tmp_path)
    metadata = checkpoint / "pytorch_model_fsdp_0" / ".metadata"
    assert checkpoint_verdict(checkpoint) is None  # torch's own DCP index references only its data classes
    real = pickle.loads(metadata.read_bytes())  # written by this test a moment ago
    for info in real.storage_data.values():
        info.relative_path = "../../elsewhere/__0_0.distcp"
    metadata.write_bytes(pickle.dumps(real))
    _refused(checkpoint, "checkpoint_unsafe_pickle", ".metadata", "../../elsewhere/__0_0.distcp")
    metadata.write_bytes(pickle.dumps(Payload(marker)))
    _refused(checkpoint, "checkpoint_unsafe_pickle", ".metadata", "builtins.exec")
    assert not marker.exists()


# ------------------------------------------------------------------------------------------------ DeepSpeed's load
class _Engine:
    """What ``DeepSpeedEngine.load_checkpoint`` asks of its engine before it reads any file: no ZeRO, no universal
    checkpoint; ``_load_checkpoint`` records the tag DeepSpeed resolved instead of loading."""

    def __init__(self) -> None:
        self.loaded: list[tuple[str, str]] = []

    def load_universal_checkpoint(self) -> bool:
        return False

    def _optimizer_has_ckpt_event_prologue(self) -> bool:
        return False

    _optimizer_has_ckpt_event_epilogue = _optimizer_has_ckpt_event_prologue
    zero_optimization = zero_nvme_offload_optimizer = _optimizer_has_ckpt_event_prologue

    def _load_checkpoint(self, load_dir, tag, **kwargs):
        self.loaded.append((load_dir, tag))
        return None, None


def test_deepspeed_loads_the_scanned_tag_even_when_latest_changes_after_the_scan(tmp_path):
    deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is part of the test extra")
    engine_class = deepspeed.runtime.engine.DeepSpeedEngine
    checkpoint = _deepspeed_checkpoint(tmp_path, manifest=False)
    assert checkpoint_verdict(checkpoint) is None
    (checkpoint / "latest").write_text(str(_forged_tag_dir(tmp_path, tmp_path / "payload-ran")))  # after the scan
    engine = _Engine()
    with deepspeed_loads_tag(str(checkpoint), "global_step2"):
        engine_class.load_checkpoint(engine, str(checkpoint))  # as transformers' deepspeed_load_checkpoint calls it
        with pytest.raises(CheckpointError) as refused:
            engine_class.load_checkpoint(engine, str(checkpoint), tag="global_step9")
        engine_class.load_checkpoint(engine, str(tmp_path / "other"), tag="global_step1")  # not the resumed one
    assert refused.value.reason_code == "checkpoint_unsafe_path"
    assert engine.loaded == [(str(checkpoint), "global_step2"), (str(tmp_path / "other"), "global_step1")]
    assert engine_class.load_checkpoint.__qualname__ == "DeepSpeedEngine.load_checkpoint"  # restored on exit


# ------------------------------------------------------------------------------------------------ real ranks
@pytest.mark.slow
@pytest.mark.distributed  # one 2-process gloo launch (~30 s on 2 cores)
def test_a_fifo_in_the_resumed_checkpoint_stops_every_rank_with_its_reason_code(tmp_path, fifo_release):
    checkpoint = tmp_path / "given" / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    os.mkfifo(checkpoint / "optimizer.pt")
    fifo_release.append(checkpoint / "optimizer.pt")
    spec = run_spec(tmp_path, "resume", max_steps=3, ddp_timeout=30, resume=str(checkpoint))
    assert run_to_end([spec], tmp_path / "resume", world_size=2, timeout=150) == [1, 1], logs(tmp_path / "resume")
    for rank in (0, 1):
        result = outcome(spec, rank)
        assert result["reason_code"] == "checkpoint_special_file" and "optimizer.pt" in result["message"], result
