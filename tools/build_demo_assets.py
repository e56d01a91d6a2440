"""Regenerate the bundled demo assets (tiny Llama snapshot + demo pairs), offline and deterministically.

Usage (from the repository root)::

    python -m tools.build_demo_assets                      # rewrite pair_dpo_trainer/assets/
    python -m tools.build_demo_assets --output-dir /tmp/a  # write elsewhere
    python -m tools.build_demo_assets --check              # compare the committed tree, write nothing

Details: tools/README.md, ``build_demo_assets.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from pair_dpo_trainer.demo import (
    DEMO_REVISION,
    DEMO_SEED,
    MODEL_DIR_NAME,
    PAIRS_FILE_NAME,
    bundled_assets_dir,
)
from pair_dpo_trainer.demo.pairs import BASE_WORDS, DEMO_NUM_PAIRS, generate_demo_pairs, pair_texts
from pair_dpo_trainer.integrity.layout import CACHEDIR_TAG_TEXT, GITIGNORE_TEXT, metadata_rel, metadata_text

# 2025-11-29T00:00:00Z. A fixed download timestamp keeps the .metadata files byte-identical across runs.
METADATA_TIMESTAMP = 1764374400.0
LFS_FILES = frozenset({"model.safetensors"})

BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, UNK_TOKEN = "<s>", "</s>", "<pad>", "<unk>"
SPECIAL_TOKENS = (UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
MODEL_MAX_LENGTH = 512

# Prefix-consistent: the prompt rendered with add_generation_prompt=True is a string prefix of the prompt plus
# its completion, and every assistant turn ends with the EOS text. Roles: system, user, assistant only.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('demo chat template: unsupported role ' + message['role']) }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|assistant|>' + message['content'] + eos_token }}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# ----------------------------------------------------------------------------------------------- tokenizer


def _content_vocab(texts: Iterable[str]) -> list[str]:
    """Return the sorted word vocabulary: base words (0-99, a-z) plus every pre-token of ``texts``.

    Args:
        texts: Training texts.

    Returns:
        list[str]: Sorted unique words, special and role tokens excluded.
    """
    splitter = pre_tokenizers.Whitespace()
    words = set(BASE_WORDS)
    for text in texts:
        words.update(word for word, _ in splitter.pre_tokenize_str(text))
    return sorted(words - set(SPECIAL_TOKENS) - set(ROLE_TOKENS))


def build_demo_backend(texts: Iterable[str]) -> Tokenizer:
    """Build the raw ``tokenizers`` word-level tokenizer (deterministic, offline).

    Ids: ``<unk>``=0, ``<s>``=1, ``</s>``=2, ``<pad>``=3, role markers 4-6, then the sorted words. Role
    markers are special added tokens, so they never merge with content. No post-processor: the chat template
    emits ``<s>``.

    Args:
        texts: Training texts (message contents).

    Returns:
        tokenizers.Tokenizer: WordLevel model with a ``Whitespace`` pre-tokenizer.
    """
    tokens = (*SPECIAL_TOKENS, *ROLE_TOKENS, *_content_vocab(texts))
    backend = Tokenizer(models.WordLevel({tok: i for i, tok in enumerate(tokens)}, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens([AddedToken(tok, special=True, normalized=False) for tok in SPECIAL_TOKENS])
    backend.add_special_tokens([AddedToken(tok, special=True, normalized=False) for tok in ROLE_TOKENS])
    return backend


def tokenizer_config() -> dict:
    """Return the ``tokenizer_config.json`` content (fixed; no transformers version inside).

    Returns:
        dict: Special tokens, ``model_max_length`` and the tokenizer class.
    """
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "backend": "tokenizers",
        "bos_token": BOS_TOKEN,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "extra_special_tokens": list(ROLE_TOKENS),
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": PAD_TOKEN,
        "padding_side": "right",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": UNK_TOKEN,
    }


def build_demo_tokenizer(texts: Iterable[str]) -> PreTrainedTokenizerFast:
    """Build the demo tokenizer: word-level, special tokens set, chat template set, max length 512.

    Args:
        texts: Training texts (message contents), e.g. ``pair_texts(generate_demo_pairs())``.

    Returns:
        PreTrainedTokenizerFast: Ready for ``apply_chat_template``.
    """
    config = tokenizer_config()
    return PreTrainedTokenizerFast(
        tokenizer_object=build_demo_backend(texts),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        extra_special_tokens=list(ROLE_TOKENS),
        model_max_length=MODEL_MAX_LENGTH,
        padding_side=config["padding_side"],
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )


# --------------------------------------------------------------------------------------------------- model


def model_config(vocab_size: int) -> dict:
    """Return the ``config.json`` content of the tiny Llama (fixed keys; no transformers version).

    Args:
        vocab_size: Tokenizer vocabulary size V.

    Returns:
        dict: Llama config: hidden 128, 4 layers, 4 heads, 2 KV heads (GQA), intermediate 256, untied head.
    """
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
        "dtype": "float32",
        "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
        "head_dim": 32,
        "hidden_act": "silu",
        "hidden_size": 128,
        "initializer_range": 0.02,
        "intermediate_size": 256,
        "max_position_embeddings": MODEL_MAX_LENGTH,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "pad_token_id": SPECIAL_TOKENS.index(PAD_TOKEN),
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def generation_config() -> dict:
    """Return the ``generation_config.json`` content (fixed; no transformers version).

    Returns:
        dict: BOS/EOS/PAD token ids.
    """
    return {
        "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
        "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
        "pad_token_id": SPECIAL_TOKENS.index(PAD_TOKEN),
    }


@torch.no_grad()
def _seeded_init(model: torch.nn.Module, seed: int, std: float) -> None:
    """Overwrite every parameter from one seeded CPU generator, in sorted name order.

    Matrices get N(0, std^2), vectors (RMSNorm scales) get ones; independent of transformers' own init order.

    Args:
        model: Model to initialise in place.
        seed: Generator seed.
        std: Standard deviation of the matrix entries.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for _, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        if param.ndim == 1:
            param.fill_(1.0)
        else:
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
            param.copy_(noise.to(param.device))


def build_demo_model(vocab_size: int, seed: int = DEMO_SEED) -> LlamaForCausalLM:
    """Build the tiny random-init Llama (float32, CPU).

    Args:
        vocab_size: Vocabulary size V (embedding and LM-head rows).
        seed: Weight seed; same seed -> identical weights.

    Returns:
        LlamaForCausalLM: Logits ``[B, T, V]`` for ``input_ids [B, T]``.
    """
    config_dict = model_config(vocab_size)
    config = LlamaConfig(**{k: v for k, v in config_dict.items() if k != "dtype"})
    model = LlamaForCausalLM(config).float()
    _seeded_init(model, seed, config_dict["initializer_range"])
    return model.eval()


# ------------------------------------------------------------------------------------------------- writing


def _json_bytes(obj: object) -> bytes:
    """Serialise JSON deterministically: sorted keys, 2-space indent, ASCII, trailing newline."""
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=True) + "\n").encode("ascii")


def pairs_jsonl_bytes(rows: Iterable[Mapping]) -> bytes:
    """Serialise rows as JSON Lines: one sorted-keys ASCII object per line, ``\\n`` line ends.

    Args:
        rows: Preference rows.

    Returns:
        bytes: The ``demo_pairs.jsonl`` content.
    """
    return "".join(json.dumps(row, sort_keys=True, ensure_ascii=True) + "\n" for row in rows).encode("ascii")


def _safetensors_bytes(model: LlamaForCausalLM) -> bytes:
    """Return the bytes ``save_pretrained(safe_serialization=True)`` writes to ``model.safetensors``."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        return (Path(tmp) / "model.safetensors").read_bytes()


def snapshot_files(seed: int = DEMO_SEED, rows: Sequence[Mapping] | None = None) -> dict[str, bytes]:
    """Build every file of the tiny-llama snapshot (without the ``.cache`` metadata).

    Args:
        seed: Weight seed (and pair seed when ``rows`` is None).
        rows: Pairs whose texts train the tokenizer; defaults to ``generate_demo_pairs(seed)``.

    Returns:
        dict[str, bytes]: Repo-relative file name -> content.
    """
    rows = generate_demo_pairs(seed) if rows is None else rows
    backend = build_demo_backend(pair_texts(rows))
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    return {
        "chat_template.jinja": CHAT_TEMPLATE.encode("ascii"),
        "config.json": _json_bytes(model_config(vocab_size)),
        "generation_config.json": _json_bytes(generation_config()),
        "model.safetensors": _safetensors_bytes(build_demo_model(vocab_size, seed)),
        "tokenizer.json": _json_bytes(json.loads(backend.to_str())),
        "tokenizer_config.json": _json_bytes(tokenizer_config()),
    }


def git_blob_sha1(data: bytes) -> str:
    """Return the Git blob id of ``data`` (what ``git hash-object`` prints; the Hub etag of non-LFS files).

    Args:
        data: File content.

    Returns:
        str: 40 lowercase hex digits.
    """
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def hub_etag(filename: str, data: bytes) -> str:
    """Return the Hub etag of a file: sha256 for LFS files, the Git blob SHA-1 otherwise.

    Args:
        filename: Repo-relative file name.
        data: File content.

    Returns:
        str: Hex digest (64 chars for LFS, 40 otherwise).
    """
    return hashlib.sha256(data).hexdigest() if filename in LFS_FILES else git_blob_sha1(data)


def download_metadata_files(files: Mapping[str, bytes], revision: str = DEMO_REVISION) -> dict[str, bytes]:
    """Build the ``.cache/huggingface`` tree ``hf download --local-dir`` leaves next to ``files``.

    Matches ``huggingface_hub._local_folder.write_download_metadata``: one
    ``f"{commit}\\n{etag}\\n{timestamp}\\n"`` per file (timestamp fixed to :data:`METADATA_TIMESTAMP`), plus
    ``.gitignore`` (``*``) and ``CACHEDIR.TAG``. The ``.lock`` files the real writer leaves behind are not
    written.

    Args:
        files: Repo-relative file name -> content.
        revision: 40-hex commit recorded in every metadata file.

    Returns:
        dict[str, bytes]: Path relative to the snapshot directory -> content.
    """
    out = {
        ".cache/huggingface/.gitignore": GITIGNORE_TEXT.encode("ascii"),
        ".cache/huggingface/CACHEDIR.TAG": CACHEDIR_TAG_TEXT.encode("ascii"),
    }
    for name in sorted(files):
        out[metadata_rel(name)] = metadata_text(revision, hub_etag(name, files[name]), METADATA_TIMESTAMP).encode()
    return out


def demo_asset_files(seed: int = DEMO_SEED, n: int = DEMO_NUM_PAIRS) -> dict[str, bytes]:
    """Build the whole asset tree in memory.

    Args:
        seed: Seed for pairs and weights.
        n: Number of pairs.

    Returns:
        dict[str, bytes]: Path relative to ``assets/`` -> content, sorted by path.
    """
    rows = generate_demo_pairs(seed, n)
    snapshot = snapshot_files(seed, rows)
    snapshot.update(download_metadata_files(snapshot))
    files = {f"{MODEL_DIR_NAME}/{name}": data for name, data in snapshot.items()}
    files[PAIRS_FILE_NAME] = pairs_jsonl_bytes(rows)
    return dict(sorted(files.items()))


def write_demo_assets(output_dir: str | Path, seed: int = DEMO_SEED, n: int = DEMO_NUM_PAIRS) -> list[Path]:
    """Regenerate the asset tree into ``output_dir`` (the old snapshot directory is replaced).

    Args:
        output_dir: Target directory, e.g. :func:`bundled_assets_dir`.
        seed: Seed for pairs and weights.
        n: Number of pairs.

    Returns:
        list[Path]: Written files, sorted.
    """
    output_dir = Path(output_dir)
    files = demo_asset_files(seed, n)
    shutil.rmtree(output_dir / MODEL_DIR_NAME, ignore_errors=True)
    written = []
    for rel, data in files.items():
        path = output_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        written.append(path)
    return written


# ---------------------------------------------------------------------------------------------------- command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line.

    Args:
        argv: Arguments without the program name; ``None`` reads ``sys.argv``.

    Returns:
        argparse.Namespace: ``seed``, ``num_pairs``, ``output_dir`` and ``check``.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=DEMO_SEED, help="seed for pairs and weights")
    parser.add_argument("--num-pairs", type=int, default=DEMO_NUM_PAIRS, help="number of preference pairs")
    parser.add_argument("--output-dir", type=Path, default=bundled_assets_dir(), help="assets directory to (re)write")
    parser.add_argument("--check", action="store_true", help="only compare output-dir with a fresh build")
    return parser.parse_args(argv)


def check_tree(output_dir: Path, files: dict[str, bytes]) -> list[str]:
    """List the differences between ``output_dir`` and the freshly built ``files``.

    Args:
        output_dir: Existing assets directory.
        files: Path relative to ``output_dir`` -> expected content.

    Returns:
        list[str]: One line per missing, extra or differing file; empty when identical.
    """
    on_disk = {
        p.relative_to(output_dir).as_posix()
        for p in output_dir.rglob("*")
        if p.is_file() and not p.name.endswith(".lock")
    }
    problems = [f"extra: {rel}" for rel in sorted(on_disk - set(files))]
    for rel, data in files.items():
        if rel not in on_disk:
            problems.append(f"missing: {rel}")
        elif (output_dir / rel).read_bytes() != data:
            problems.append(f"differs: {rel}")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    """Build the assets, then write them (or compare them with ``--check``).

    Args:
        argv: Arguments without the program name.

    Returns:
        int: Exit status (0 on success, 1 when ``--check`` finds differences).
    """
    args = parse_args(argv)
    files = demo_asset_files(args.seed, args.num_pairs)
    if args.check:
        problems = check_tree(args.output_dir, files)
        print("\n".join(problems) or f"OK: {len(files)} files match")
        return 1 if problems else 0
    write_demo_assets(args.output_dir, args.seed, args.num_pairs)
    for rel, data in files.items():
        print(f"{hashlib.sha256(data).hexdigest()}  {len(data):>9}  {rel}")
    print(f"total {sum(len(d) for d in files.values())} bytes in {len(files)} files -> {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
