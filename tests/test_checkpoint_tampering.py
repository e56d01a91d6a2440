"""A checkpoint whose bytes changed since it was saved, or whose pickles reference code, is never resumed.

One real ``train.py`` run of the bundled tiny model (3 steps, a checkpoint at step 2) is copied per test, tampered
with, and resumed by ``train.py``: the resume must exit 1 with the reason code, and the payload of a crafted pickle (it
writes a marker file when unpickled) must not have run. Each refusal code is seen once from a real ``train.py``
process (``checkpoint_tampered``: the swapped pickle; ``checkpoint_unsafe_pickle``: the vouched-for pickle); the other
tamperings run the same argv through ``train.run`` in this process, which prints the same one-line error and returns
the same exit code without paying a launch's imports.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pair_dpo_trainer.fault_tolerance.checkpoint import MANIFEST_FILENAME, MANIFEST_FORMAT, read_manifest
from pair_dpo_trainer.fault_tolerance.checkpoint_trust import checkpoint_verdict
from pair_dpo_trainer.integrity.pickles import pickle_problem
from tests.faults import logs, outcome, run_spec, run_to_end

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3


class Payload:
    """Unpickled, it runs ``exec``: writes ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def _argv(out: Path, *extra: str) -> list[str]:
    argv = ["--output_dir", str(out), "--max_steps", str(STEPS), "--save_steps", "2", "--eval_strategy", "no"]
    return [*argv, "--use_cpu", "true", "--disable_tqdm", "true", *extra]


def _train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    env.pop("PAIR_DPO_DEBUG", None)
    command = [sys.executable, str(ROOT / "train.py"), *_argv(out, *extra)]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)


def _train_in_process(out: Path, capsys, monkeypatch, *extra: str) -> subprocess.CompletedProcess:
    """The argv of :func:`_train` through ``train.run`` in this process: its exit code and what it wrote to stderr,
    shaped as :func:`_train`'s result (what ``train.py``'s ``__main__`` exits with and prints is exactly this)."""
    sys.path.insert(0, str(ROOT))
    import train

    monkeypatch.delenv("PAIR_DPO_DEBUG", raising=False)
    capsys.readouterr()
    code = train.run(_argv(out, *extra))
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(["train.py"], code, captured.out, captured.err)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """The output_dir of one uninterrupted run: ``checkpoint-2``, the final weights of step 3."""
    out = tmp_path_factory.mktemp("saved") / "run"
    done = _train(out)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (out / "checkpoint-2").is_dir()
    return out


@pytest.fixture
def run_copy(saved, tmp_path) -> Path:
    """A copy of the saved run's ``checkpoint-2`` alone (the newest there), to tamper with."""
    out = tmp_path / "run"
    shutil.copytree(saved / "checkpoint-2", out / "checkpoint-2")
    return out


def _forge(path: Path, marker: Path) -> None:
    torch.save(Payload(marker), path)  # a zip archive whose data.pkl calls builtins.exec


def _record(checkpoint: Path, name: str, *, digest: bool) -> None:
    """Rewrites the manifest's size (and with ``digest`` its SHA-256) of ``name`` to the file's current bytes."""
    manifest = read_manifest(checkpoint)
    data = (checkpoint / name).read_bytes()
    manifest["files"][name] = len(data)
    if digest:
        manifest["sha256"][name] = hashlib.sha256(data).hexdigest()
    (checkpoint / MANIFEST_FILENAME).write_text(json.dumps(manifest))


def _refused(done: subprocess.CompletedProcess, code: str, name: str) -> None:
    assert done.returncode == 1, done.stderr[-4000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("train.py: error:")]
    assert len(lines) == 1 and f"[{code}]" in lines[0] and name in lines[0], done.stderr[-4000:]


@pytest.mark.integration  # the module's `saved` run trains first
def test_the_manifest_records_the_sha256_of_every_file(saved):
    checkpoint = saved / "checkpoint-2"
    manifest = read_manifest(checkpoint)
    assert manifest["format"] == MANIFEST_FORMAT == 2
    assert set(manifest["sha256"]) == set(manifest["files"]) and "model.safetensors" in manifest["files"]
    for name, digest in manifest["sha256"].items():
        assert digest == hashlib.sha256((checkpoint / name).read_bytes()).hexdigest(), name
    assert checkpoint_verdict(checkpoint) is None


@pytest.mark.slow  # one resume subprocess per test (~30 s on 2 shared cores)
def test_a_pickle_swapped_in_with_its_size_recorded_is_refused_as_tampered_and_never_unpickled(run_copy, tmp_path):
    checkpoint, marker = run_copy / "checkpoint-2", tmp_path / "payload-ran"
    _forge(checkpoint / "optimizer.pt", marker)
    _record(checkpoint, "optimizer.pt", digest=False)
    done = _train(run_copy, "--resume_from_checkpoint", "latest")
    _refused(done, "checkpoint_tampered", "optimizer.pt")
    assert "Resume from another checkpoint" in done.stderr and not marker.exists()


@pytest.mark.integration  # the module's `saved` run trains first
def test_weights_changed_at_the_same_size_are_refused_as_tampered(run_copy, capsys, monkeypatch):
    """In process: ``checkpoint_tampered`` from a real ``train.py`` launch is the swapped pickle's test above."""
    weights = run_copy / "checkpoint-2" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(b ^ 0xFF for b in data[-8:])  # the last tensor's last bytes
    weights.write_bytes(bytes(data))
    done = _train_in_process(run_copy, capsys, monkeypatch, "--resume_from_checkpoint", "latest")
    _refused(done, "checkpoint_tampered", "model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("manifest", ["rewritten", "removed"])
def test_code_in_a_pickle_is_refused_even_when_the_manifest_vouches_for_it_or_there_is_none(
    run_copy, tmp_path, capsys, monkeypatch, manifest
):
    """``rewritten`` resumes in a real ``train.py`` process; ``removed`` (the same refusal, the same code path after
    the manifest is found missing) through ``train.run`` in this process."""
    checkpoint, marker = run_copy / "checkpoint-2", tmp_path / "payload-ran"
    _forge(checkpoint / "rng_state.pth", marker)
    if manifest == "rewritten":
        _record(checkpoint, "rng_state.pth", digest=True)
        done = _train(run_copy, "--resume_from_checkpoint", str(checkpoint))
    else:
        (checkpoint / MANIFEST_FILENAME).unlink()
        done = _train_in_process(run_copy, capsys, monkeypatch, "--resume_from_checkpoint", str(checkpoint))
    _refused(done, "checkpoint_unsafe_pickle", "rng_state.pth")
    assert "builtins.exec" in done.stderr and not marker.exists()


@pytest.mark.slow
@pytest.mark.integration  # the module's `saved` run trains first
def test_an_untouched_checkpoint_resumes_to_the_uninterrupted_weights(saved, run_copy):
    done = _train(run_copy, "--resume_from_checkpoint", "latest")
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"resuming from {run_copy / 'checkpoint-2'}" in done.stderr
    resumed, straight = load_file(run_copy / "model.safetensors"), load_file(saved / "model.safetensors")
    assert set(resumed) == set(straight) and len(straight) > 0
    for key, value in straight.items():
        torch.testing.assert_close(resumed[key], value, atol=1e-6, rtol=0, msg=key)


# ------------------------------------------------------------------------------------------------ DeepSpeed ZeRO-3
@pytest.fixture(scope="module")
def zero3_checkpoint(tmp_path_factory) -> Path:
    """``checkpoint-2`` of a 2-step ZeRO-3 run on 2 CPU processes (tests/fault_worker.py, gloo)."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is part of the test extra: pip install -e '.[test]'")
    from tests.test_deepspeed import DS_CONFIG

    root = tmp_path_factory.mktemp("zero3")
    spec = run_spec(root, "run", max_steps=2, deepspeed=DS_CONFIG, ddp_timeout=120)
    assert run_to_end([spec], root / "run", world_size=2) == [0, 0], logs(root / "run")
    return Path(spec["out"]) / "checkpoint-2"


@pytest.mark.slow
@pytest.mark.distributed  # one ZeRO-3 resume launch of 2 processes (~1 min on 2 cores) after the module's ZeRO-3 run
def test_a_zero3_checkpoint_with_code_in_a_pickle_or_a_latest_outside_is_refused_on_every_rank_never_unpickled(
    zero3_checkpoint, tmp_path
):
    """Two forged copies of the ZeRO-3 checkpoint resumed one after the other by the same 2 ranks (``then_next``:
    the first refusal is recorded and the ranks go on to the second), each refusal seen on every rank:

    - ``sized``: a model-states pickle that runs code, its size and then its SHA-256 recorded in the manifest:
      ``checkpoint_tampered`` in process while only the size matches, ``checkpoint_unsafe_pickle`` once the manifest
      vouches for it;
    - ``outside``: no manifest, ``latest`` naming a directory outside the checkpoint whose model-states pickles (what
      DeepSpeed unpickles first on each rank, with ``weights_only=False``) run code: ``checkpoint_unsafe_path``.
    """
    from tests.test_deepspeed import DS_CONFIG

    name = "global_step2/zero_pp_rank_0_mp_rank_00_model_states.pt"
    assert name in read_manifest(zero3_checkpoint)["files"]
    assert checkpoint_verdict(zero3_checkpoint) is None  # real ZeRO-3 files reference only allowed globals
    marker = tmp_path / "payload-ran"
    sized = tmp_path / "sized" / "checkpoint-2"
    shutil.copytree(zero3_checkpoint, sized)
    _forge(sized / name, marker)
    _record(sized, name, digest=False)
    verdict = checkpoint_verdict(sized)
    assert verdict is not None and verdict[0] == "checkpoint_tampered" and name in verdict[1]

    spec = run_spec(tmp_path, "resume", max_steps=3, deepspeed=DS_CONFIG, ddp_timeout=120, resume="latest")
    forged = Path(spec["out"]) / "checkpoint-2"
    shutil.copytree(sized, forged)
    _record(forged, name, digest=True)  # the manifest vouches for the forged file

    elsewhere = tmp_path / "elsewhere" / "global_step2"
    shutil.copytree(zero3_checkpoint / "global_step2", elsewhere)
    for rank in (0, 1):  # what DeepSpeed unpickles first on each rank, with weights_only=False
        _forge(elsewhere / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt", marker)
    outside = run_spec(tmp_path, "outside", max_steps=3, deepspeed=DS_CONFIG, ddp_timeout=120)
    checkpoint = Path(outside["out"]) / "checkpoint-2"
    shutil.copytree(zero3_checkpoint, checkpoint)
    (checkpoint / MANIFEST_FILENAME).unlink()  # another trainer's checkpoint: only its pickles are scanned
    (checkpoint / "latest").write_text(str(elsewhere))  # DeepSpeed joins an absolute tag as it is
    outside["resume"] = str(checkpoint)

    runs = [{**spec, "then_next": True}, outside]
    assert run_to_end(runs, tmp_path / "resume", world_size=2) == [1, 1], logs(tmp_path / "resume")
    for rank in (0, 1):
        result = outcome(spec, rank)
        assert result["reason_code"] == "checkpoint_unsafe_pickle" and name in result["message"], result
    assert "builtins.exec" in outcome(spec, 0)["message"] and not marker.exists()
    for rank in (0, 1):
        result = outcome(outside, rank)
        assert result["reason_code"] == "checkpoint_unsafe_path" and "latest" in result["message"], result
    assert not marker.exists()


# ------------------------------------------------------------------------------------------------ in process
@pytest.mark.integration  # the module's `saved` run trains first
def test_an_extra_weights_file_or_a_manifest_without_hashes_is_refused_as_tampered(saved, tmp_path):
    checkpoint = tmp_path / "checkpoint-2"
    shutil.copytree(saved / "checkpoint-2", checkpoint)
    shutil.copy(checkpoint / "model.safetensors", checkpoint / "pytorch_model.bin")
    verdict = checkpoint_verdict(checkpoint)
    assert verdict is not None and verdict[0] == "checkpoint_tampered" and "pytorch_model.bin" in verdict[1]
    (checkpoint / "pytorch_model.bin").unlink()
    manifest = read_manifest(checkpoint)
    del manifest["sha256"]
    (checkpoint / MANIFEST_FILENAME).write_text(json.dumps({**manifest, "format": 1}))
    verdict = checkpoint_verdict(checkpoint)
    assert verdict is not None and verdict[0] == "checkpoint_tampered" and "records no SHA-256" in verdict[1]


@pytest.mark.integration  # the module's `saved` run trains first
def test_the_pickle_scan_names_code_and_refuses_what_it_cannot_read(saved, tmp_path):
    marker = tmp_path / "payload-ran"
    assert pickle_problem(saved / "checkpoint-2" / "rng_state.pth") is None  # numpy's RNG state is allowed
    _forge(tmp_path / "exec.pt", marker)
    assert "builtins.exec" in pickle_problem(tmp_path / "exec.pt")
    torch.save({"f": os.system}, tmp_path / "system.pt")
    assert f"{os.system.__module__}.system" in pickle_problem(tmp_path / "system.pt")
    (tmp_path / "raw.pkl").write_bytes(pickle.dumps(Payload(marker)))
    assert "not a torch.save zip archive" in pickle_problem(tmp_path / "raw.pkl")
    assert not marker.exists()
