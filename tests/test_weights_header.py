"""Safetensors headers: the parser of ``integrity/weights.py`` against the safetensors library, and a broken weights
file refused by ``pair-dpo pin``, ``pair-dpo verify-snapshot`` and ``train.py`` (``bad_weights``) before any tensor
is loaded."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save, save_file

from pair_dpo_trainer.demo import DEMO_REVISION, bundled_model_dir, bundled_pairs_path
from pair_dpo_trainer.errors import SnapshotIntegrityError
from pair_dpo_trainer.integrity import pin_snapshot
from pair_dpo_trainer.integrity.weights import DTYPE_BITS, header_problem, read_head
from tests.test_user_errors import _script_env, _train_command
from tools.build_demo_assets import download_metadata_files

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = "model.safetensors"


def _problem(path: Path) -> str | None:
    return header_problem(*read_head(path))


def _library_opens(path: Path) -> bool:
    """The safetensors library's reader: it parses and validates the header, then maps the tensors."""
    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                f.get_tensor(name)
    except Exception:  # noqa: BLE001 - SafetensorError, or any error of a file it cannot read
        return False
    return True


def _framed(text: bytes, data: bytes = b"") -> bytes:
    return len(text).to_bytes(8, "little") + text + data


def _raw(header: object, data: bytes) -> bytes:
    return _framed(json.dumps(header).encode(), data)


def _good_files() -> dict[str, bytes]:
    gen = torch.Generator().manual_seed(0)
    mixed = {
        "a": torch.randn(3, 5, generator=gen),
        "b": torch.randn(7, generator=gen).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "empty": torch.zeros(0, 4),
        "mask": torch.tensor([True, False, True]),
    }
    return {
        "bundled": (bundled_model_dir() / WEIGHTS).read_bytes(),
        "mixed dtypes": save(mixed, metadata={"format": "pt"}),
        "no tensors": save({}),
        "padded header": _raw({"t": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "__metadata__": {}}, b"ab"),
    }


def _bad_files() -> dict[str, bytes]:
    bundled = (bundled_model_dir() / WEIGHTS).read_bytes()
    n = int.from_bytes(bundled[:8], "little")
    header = json.loads(bundled[8 : 8 + n])
    name = next(k for k in sorted(header) if k != "__metadata__")
    beyond = json.loads(json.dumps(header))
    last = max((k for k in beyond if k != "__metadata__"), key=lambda k: beyond[k]["data_offsets"][1])
    beyond[last]["data_offsets"][1] += 4  # ends past the file's last byte
    unknown = json.loads(json.dumps(header))
    unknown[name]["dtype"] = "F128"
    one = {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    return {
        "0 bytes": b"",
        "random bytes": random.Random(0).randbytes(len(bundled)),
        "truncated": bundled[:-1],
        "trailing bytes": bundled + b"\0",
        "header length larger than the file": (len(bundled) * 2).to_bytes(8, "little") + bundled[8:],
        "offsets beyond the end": _raw(beyond, bundled[8 + n :]),
        "unknown dtype": _raw(unknown, bundled[8 + n :]),
        "span not its shape": _raw({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
        "gap": _raw({"t": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12),
        "not an object": _raw([1, 2], b""),
        "nested too deep": _framed(b"[" * 100_000 + b"]" * 100_000),
        "header length only": (16).to_bytes(8, "little"),
        "one tensor, too few bytes": _raw(one, b"\0" * 4),
    }


@pytest.mark.parametrize("case", sorted(_good_files()))
def test_the_parser_accepts_what_the_safetensors_library_opens(tmp_path, case):
    path = tmp_path / WEIGHTS
    path.write_bytes(_good_files()[case])
    assert _library_opens(path)
    assert _problem(path) is None


@pytest.mark.parametrize("case", sorted(_bad_files()))
def test_the_parser_refuses_what_the_safetensors_library_refuses(tmp_path, case):
    path = tmp_path / WEIGHTS
    path.write_bytes(_bad_files()[case])
    assert not _library_opens(path)
    problem = _problem(path)
    assert isinstance(problem, str) and problem


@pytest.mark.parametrize("dtype", sorted(DTYPE_BITS))
def test_every_dtype_the_parser_knows_the_library_opens(tmp_path, dtype):
    count = 16  # a whole number of bytes for every element size (4, 6, 8, ... bits)
    size = count * DTYPE_BITS[dtype] // 8
    path = tmp_path / WEIGHTS
    path.write_bytes(_raw({"t": {"dtype": dtype, "shape": [count], "data_offsets": [0, size]}}, b"\0" * size))
    assert _problem(path) is None
    with safe_open(str(path), framework="np") as f:  # the header is accepted (numpy has no float8 to map to)
        assert list(f.keys()) == ["t"]


def test_the_header_is_read_without_the_tensors(tmp_path):
    path = tmp_path / WEIGHTS
    save_file({"big": torch.zeros(1 << 20)}, str(path))  # 4 MiB of data after a small header
    head, size = read_head(path)
    assert size == path.stat().st_size and len(head) == 8 + int.from_bytes(head[:8], "little") < 200


# ------------------------------------------------------------------------------------------------ the commands


def _cli(*argv: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pair_dpo_trainer.cli", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def _unpinned_copy(tmp_path: Path, name: str) -> Path:
    """The bundled model as a directory saved locally: no download metadata."""
    target = tmp_path / name
    shutil.copytree(bundled_model_dir(), target, ignore=shutil.ignore_patterns(".cache"))
    return target


def _broken(size: int) -> dict[str, bytes]:
    return {"0 bytes": b"", "random bytes": random.Random(1).randbytes(size)}


@pytest.mark.parametrize("case", ["0 bytes", "random bytes"])
def test_pin_refuses_broken_weights_and_pins_the_untouched_copy(tmp_path, case):
    good = _unpinned_copy(tmp_path, "good")
    broken = _unpinned_copy(tmp_path, "broken")
    (broken / WEIGHTS).write_bytes(_broken((good / WEIGHTS).stat().st_size)[case])
    done = _cli("pin", str(broken))
    assert done.returncode != 0
    assert "[bad_weights]" in done.stdout and WEIGHTS in done.stdout and "re-save" in done.stdout
    assert not (broken / ".cache").exists()  # nothing pinned
    pinned = _cli("pin", str(good))
    assert pinned.returncode == 0 and "PINNED" in pinned.stdout, pinned.stdout + pinned.stderr


def _snapshot_with_weights(tmp_path: Path, data: bytes) -> Path:
    """A copy of the bundled snapshot whose weights are ``data`` and whose download metadata records ``data``:
    the hashes verify, as for a commit that holds such a file."""
    target = tmp_path / "snapshot"
    shutil.copytree(bundled_model_dir(), target)
    (target / WEIGHTS).write_bytes(data)
    for rel, content in download_metadata_files({WEIGHTS: data}, DEMO_REVISION).items():
        if rel.endswith(".metadata"):
            (target / rel).write_bytes(content)
    return target


@pytest.mark.parametrize("case", ["0 bytes", "random bytes"])
def test_verify_snapshot_refuses_broken_weights_even_when_their_hash_matches(tmp_path, case):
    size = (bundled_model_dir() / WEIGHTS).stat().st_size
    snapshot = _snapshot_with_weights(tmp_path, _broken(size)[case])
    done = _cli("verify-snapshot", str(snapshot), "--revision", DEMO_REVISION)
    assert done.returncode == 1
    assert "[bad_weights]" in done.stdout and WEIGHTS in done.stdout, done.stdout + done.stderr


def test_pin_refuses_a_broken_shard_listed_in_the_index(tmp_path):
    model_dir = tmp_path / "sharded"
    model_dir.mkdir()
    shutil.copy(bundled_model_dir() / "config.json", model_dir)
    first, second = (model_dir / f"model-0000{i}-of-00002.safetensors" for i in (1, 2))
    save_file({"a": torch.ones(4)}, str(first))
    save_file({"b": torch.ones(2)}, str(second))
    index = {"metadata": {}, "weight_map": {"a": first.name, "b": second.name}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    os.truncate(second, second.stat().st_size - 1)
    with pytest.raises(SnapshotIntegrityError) as info:
        pin_snapshot(model_dir)
    assert info.value.reason_code == "bad_weights" and info.value.path == second.name
    assert "truncated" in info.value.message


@pytest.mark.integration
def test_train_script_refuses_broken_reference_weights_before_loading_them(tmp_path):
    snapshot = _snapshot_with_weights(tmp_path, b"")
    argv = [
        *("--model_name_or_path", str(snapshot), "--dataset", str(bundled_pairs_path())),
        *("--output_dir", str(tmp_path / "out"), "--use_cpu", "true", "--max_steps", "1"),
        *("--ref_model_revision", DEMO_REVISION, "--report_to", "none"),
    ]
    done = subprocess.run(
        _train_command(*argv), capture_output=True, text=True, timeout=300, env=_script_env(tmp_path), cwd=tmp_path
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert "[bad_weights]" in done.stderr and WEIGHTS in done.stderr
    assert "SafetensorError" not in done.stderr and "Loading weights" not in done.stderr
