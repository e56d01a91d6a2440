"""Bundled demo assets: byte-exact rebuild, offline loading, pairs, chat template, hub metadata, size."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from huggingface_hub._local_folder import read_download_metadata
from transformers import AutoModelForCausalLM, AutoTokenizer

from pair_dpo_trainer import demo
from pair_dpo_trainer.demo import pairs as demo_pairs
from tools import build_demo_assets as demo_assets

ASSETS = demo.bundled_assets_dir()
MODEL_DIR = demo.bundled_model_dir()
CACHE_PREFIX = ".cache/"


def _tree(root: Path) -> dict[str, str]:
    """Map every file under ``root`` (``.lock`` files aside) to its sha256 hex digest."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.endswith(".lock")
    }


def _snapshot_files() -> list[str]:
    """Repo-relative names of the snapshot files (the ``.cache`` bookkeeping excluded)."""
    return sorted(rel for rel in _tree(MODEL_DIR) if not rel.startswith(CACHE_PREFIX))


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return [json.loads(line) for line in demo.bundled_pairs_path().read_text(encoding="ascii").splitlines()]


def test_regeneration_is_byte_identical(tmp_path):
    demo_assets.write_demo_assets(tmp_path)
    fresh, committed = _tree(tmp_path), _tree(ASSETS)
    hint = "regenerate with python -m tools.build_demo_assets; stage .cache with `git add -f` (its .gitignore is '*')"
    assert sorted(fresh) == sorted(committed), hint
    assert [rel for rel in fresh if fresh[rel] != committed[rel]] == [], hint
    # A second in-memory build (fresh model, fresh tokenizer) gives the same bytes again.
    again = {rel: hashlib.sha256(data).hexdigest() for rel, data in demo_assets.demo_asset_files().items()}
    assert again == fresh


def test_model_and_tokenizer_load_offline(monkeypatch, tokenizer):
    def no_network(*args, **kwargs):
        raise OSError("network access attempted while loading the bundled demo assets")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket.socket, "connect", no_network)
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR).eval()
    assert tok.chat_template == demo_assets.CHAT_TEMPLATE
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == ("<s>", "</s>", "<pad>", "<unk>")
    assert tok.model_max_length == 512
    assert model.dtype == torch.float32 and model.config.vocab_size == len(tok)
    messages = [
        {"role": "user", "content": "sort ascending: 3 9 1 4"},
        {"role": "assistant", "content": "1 3 4 9"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == "<s><|user|>sort ascending: 3 9 1 4\n<|assistant|>1 3 4 9</s>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tok))
    assert torch.isfinite(logits).all()


def test_demo_pairs_shape(rows):
    assert len(rows) >= 2000
    assert rows == demo_pairs.generate_demo_pairs(demo.DEMO_SEED, len(rows))
    prompts = [row["prompt"][0]["content"] for row in rows]
    assert len(set(prompts)) == len(prompts)
    lengths = set()
    for row in rows:
        assert sorted(row) == ["chosen", "prompt", "rejected"]
        assert [m["role"] for m in row["prompt"]] == ["user"]
        assert [m["role"] for m in row["chosen"]] == [m["role"] for m in row["rejected"]] == ["assistant"]
        chosen, rejected = row["chosen"][0]["content"].split(), row["rejected"][0]["content"].split()
        diff = [j for j, (c, r) in enumerate(zip(chosen, rejected, strict=True)) if c != r]
        assert len(chosen) == len(rejected) and len(diff) == 2 and diff[1] == diff[0] + 1
        assert (chosen[diff[0]], chosen[diff[1]]) == (rejected[diff[1]], rejected[diff[0]])
        lengths.add(len(chosen))
    assert lengths == set(range(3, 13))


@pytest.mark.parametrize("index", [0, 1, 2, 3, 4, 1234])
def test_chat_template_is_prefix_consistent(tokenizer, rows, index):
    row = rows[index]
    prompt = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert prompt_ids[0] == tokenizer.bos_token_id and prompt_ids.count(tokenizer.bos_token_id) == 1
    for key in ("chosen", "rejected"):
        full = tokenizer.apply_chat_template(row["prompt"] + row[key], tokenize=False)
        assert full.startswith(prompt) and full.endswith(tokenizer.eos_token)
        full_ids = tokenizer(full, add_special_tokens=False)["input_ids"]
        assert full_ids[: len(prompt_ids)] == prompt_ids
        assert full_ids[-1] == tokenizer.eos_token_id and tokenizer.unk_token_id not in full_ids
        direct = tokenizer.apply_chat_template(row["prompt"] + row[key], tokenize=True, return_dict=True)
        assert list(direct["input_ids"]) == full_ids


def test_download_metadata_matches_hf_local_dir_format(tmp_path):
    assert re.fullmatch(r"[0-9a-f]{40}", demo.DEMO_REVISION)
    names = _snapshot_files()
    metadata = sorted(rel for rel in _tree(MODEL_DIR) if rel.startswith(".cache/huggingface/download/"))
    assert metadata == [f".cache/huggingface/download/{name}.metadata" for name in names]
    assert (MODEL_DIR / ".cache/huggingface/.gitignore").read_bytes() == b"*"
    # read_download_metadata writes .lock files and ignores metadata older than the file: read a copy whose
    # mtimes are set to the recorded download time, as right after `hf download`.
    local = shutil.copytree(MODEL_DIR, tmp_path / "snapshot")
    git_ids = _git_hash_objects([local / name for name in names])
    for name, git_id in zip(names, git_ids, strict=True):
        os.utime(local / name, (demo_assets.METADATA_TIMESTAMP, demo_assets.METADATA_TIMESTAMP))
        raw = (MODEL_DIR / f".cache/huggingface/download/{name}.metadata").read_text(encoding="ascii")
        assert raw.endswith("\n") and len(raw.splitlines()) == 3
        meta = read_download_metadata(local, name)
        assert meta is not None and meta.commit_hash == demo.DEMO_REVISION
        assert meta.timestamp == demo_assets.METADATA_TIMESTAMP
        if name in demo_assets.LFS_FILES:
            assert meta.etag == hashlib.sha256((MODEL_DIR / name).read_bytes()).hexdigest()
        else:
            assert meta.etag == git_id


def _git_hash_objects(paths: list[Path]) -> list[str]:
    """Return ``git hash-object`` of each path (skips the test when git is missing)."""
    if shutil.which("git") is None:
        pytest.skip("git not installed")
    out = subprocess.run(["git", "hash-object", *map(str, paths)], capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_assets_are_small():
    total = sum(p.stat().st_size for p in ASSETS.rglob("*") if p.is_file())
    assert total < 5 * 1024 * 1024, total
