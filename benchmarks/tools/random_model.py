#!/usr/bin/env python
"""Write a random-init Llama with the bundled tokenizer as a pinned-looking local snapshot (for scale tests).

Usage::

    python -m benchmarks.tools.random_model --out /data/llama-0.5b-random              # ~0.5B parameters, bf16
    python -m benchmarks.tools.random_model --out /tmp/tiny --hidden 64 --layers 2 --intermediate 128 --heads 4

The directory holds ``config.json``, ``model.safetensors``, the bundled word-level tokenizer and chat template, and
the ``.cache/huggingface/download/*.metadata`` records that ``hf download --local-dir`` writes, all naming one
40-hex revision derived from the file contents (written by ``pair-dpo pin``'s ``pin_snapshot``). The last line printed
is that revision: pass it as ``--ref_model_revision`` and the reference is verified like a real pinned download (or
pass ``--allow_unpinned_reference true`` instead). The same arguments give byte-identical model files and the same
revision.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pair_dpo_trainer.demo import bundled_model_dir
from pair_dpo_trainer.integrity import pin_snapshot

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``argv`` without the program name; None reads ``sys.argv``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory (created; must not exist)")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size")
    parser.add_argument("--layers", type=int, default=24, help="decoder layers")
    parser.add_argument("--intermediate", type=int, default=5632, help="MLP intermediate size")
    parser.add_argument("--heads", type=int, default=16, help="attention heads")
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="saved weight dtype")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed")
    return parser.parse_args(argv)


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    """A randomly initialised Llama whose vocabulary and special tokens are the bundled tokenizer's."""
    bundled = LlamaConfig.from_pretrained(bundled_model_dir())
    config = LlamaConfig(
        vocab_size=bundled.vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads or args.heads,
        max_position_embeddings=bundled.max_position_embeddings,
        bos_token_id=bundled.bos_token_id,
        eos_token_id=bundled.eos_token_id,
        pad_token_id=bundled.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config).to(getattr(torch, args.dtype))


def main(argv: Sequence[str] | None = None) -> int:
    """Writes the snapshot and prints its parameter count and revision (last line)."""
    args = parse_args(argv)
    if args.out.exists():
        print(f"make_random_model: {args.out} exists; choose a new directory", file=sys.stderr)
        return 2
    model = build_model(args)
    model.save_pretrained(args.out)
    for name in TOKENIZER_FILES:
        shutil.copyfile(bundled_model_dir() / name, args.out / name)
    revision = pin_snapshot(args.out).revision  # what `pair-dpo pin DIR` does
    print(f"parameters: {model.num_parameters():,} ({args.dtype}) in {args.out}")
    print(revision)
    return 0


if __name__ == "__main__":
    sys.exit(main())
