"""``pair-dpo prepare-data``: normalise, tokenise and split preference data into a reproducible directory.

``pair-dpo prepare-data INPUT [INPUT...] --output DIR --tokenizer PATH [--train-size N] [--eval-size M] [--seed S]``

Details: data/README.md, "Module notes", ``prepare.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import secrets
import shutil
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pair_dpo_trainer.data.fingerprint import tokenizer_fingerprint
from pair_dpo_trainer.data.prepare_rows import Candidate, PromptGroups, ReadResult, read_inputs, write_splits
from pair_dpo_trainer.data.prepared import MANIFEST_FORMAT
from pair_dpo_trainer.data.readers import FORMATS, input_format, sha256_file
from pair_dpo_trainer.data.splits import split_by_prompt, split_groups
from pair_dpo_trainer.data.workers import resolve_num_proc

DEFAULT_SEED = 42
"""``--seed`` when not given: ``TrainingArguments``' default seed, so ``--eval-size M`` holds out the pairs that
``train.py --dataset FILE --eval_size M`` holds out from the same file."""

OUTPUT_FILES: tuple[str, ...] = ("train.jsonl", "eval.jsonl", "train.arrow", "eval.arrow", "manifest.json")
CANDIDATES = ".candidates.arrow"  # inside the staging directory only

__all__ = ["Candidate", "OUTPUT_FILES", "PrepareReport", "Split", "UsageError", "prepare", "select_split"]


class UsageError(Exception):
    """A problem with the arguments or inputs of ``prepare-data``: reported on stderr with exit code 2."""


@dataclass(frozen=True)
class LoadedTokenizer:
    """The tokenizer and what the manifest records about it."""

    tokenizer: Any
    info: dict[str, Any]


@dataclass(frozen=True)
class Split:
    """The selected train and eval rows."""

    train: list[Any]
    eval: list[Any]


@dataclass(frozen=True)
class Selection:
    """The candidates chosen for each split: ``int64`` candidate numbers, ascending (input order)."""

    train: np.ndarray
    eval: np.ndarray


@dataclass(frozen=True)
class PrepareReport:
    """What one ``prepare-data`` run read, kept and wrote, for its summary lines."""

    tally: Any
    num_inputs: int
    num_train: int
    num_eval: int
    rate: str
    workers: int
    split_seconds: float
    write_seconds: float


def prepare(args: argparse.Namespace) -> PrepareReport:
    """Runs ``prepare-data`` with the options of :mod:`pair_dpo_trainer.cli.prepare_data` (an argparse namespace).

    Raises:
        UsageError / InputError / PairDPOError: a usage or input problem (the output directory is left untouched).
    """
    args = _resolve_defaults(args)
    _check_args(args)
    output = _check_output(Path(args.output), overwrite=args.overwrite)
    loaded = _load_tokenizer(args.tokenizer)
    with _staged(output) as tmp:
        read = _read_all(args, loaded.tokenizer, tmp / CANDIDATES)
        rate, started = read.tally.rate(), time.perf_counter()
        groups = read.groups()
        split = _select(groups, read, args)
        split_seconds, started = time.perf_counter() - started, time.perf_counter()
        outputs = write_splits(tmp, read, {"train": split.train, "eval": split.eval})
        write_seconds = time.perf_counter() - started
        (tmp / CANDIDATES).unlink()
        text = json.dumps(
            {**_manifest(args, read, loaded.info, split, groups), "outputs": outputs}, indent=2, sort_keys=True
        )
        (tmp / "manifest.json").write_bytes((text + "\n").encode("utf-8"))
    return PrepareReport(
        read.tally,
        len(read.inputs),
        len(split.train),
        len(split.eval),
        rate,
        read.workers,
        split_seconds,
        write_seconds,
    )


def select_split(candidates: list[Candidate], *, train_size: int, eval_size: int, seed: int) -> Split:
    """Chooses eval then train pairs from whole prompt groups, deterministically from ``seed``.

    Groups are visited in the order of ``sha256(seed, prompt_hash)``, which depends neither on the input
    order nor on the Python version. Eval takes every group that fits in its remaining need; if it is still
    short, it takes part of the smallest remaining group (the rest of that group is dropped). Train then
    takes groups in order, the last one possibly in part. A split that cannot be filled comes back short.
    """
    train_rows, eval_rows = split_by_prompt(
        candidates, lambda c: c.prompt_hash, train_size=train_size, eval_size=eval_size, seed=seed
    )
    return Split(train=train_rows, eval=eval_rows)


def _resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """The options with their defaults filled in: the prompt limit by the trainer's rule
    (:func:`~pair_dpo_trainer.config.arguments.default_max_prompt_length`), the optional fields that a namespace built
    by hand may lack."""
    from pair_dpo_trainer.config.arguments import default_max_prompt_length

    values = {
        "train_size": None,
        "eval_size": 0,
        "seed": DEFAULT_SEED,
        "max_prompt_length": None,
        "apply_chat_template_to_strings": False,
        **vars(args),
    }
    if values["max_prompt_length"] is None and isinstance(values["max_length"], int):
        values["max_prompt_length"] = default_max_prompt_length(values["max_length"])
    return argparse.Namespace(**values)


def _check_args(args: argparse.Namespace) -> None:
    if args.train_size is not None and args.train_size < 1:
        raise UsageError(f"--train-size={args.train_size}: select at least 1 train pair (or leave it unset: all).")
    if args.eval_size < 0:
        raise UsageError(f"--eval-size={args.eval_size}: must be >= 0.")
    if args.max_length < 2:
        raise UsageError(f"--max-length={args.max_length}: must be >= 2.")
    if not 0 < args.max_prompt_length < args.max_length:
        raise UsageError(
            f"--max-prompt-length={args.max_prompt_length}: set 0 < P < --max-length "
            f"({args.max_length}) so every completion keeps at least one token."
        )
    if args.max_tokens_per_microbatch is not None and args.max_tokens_per_microbatch < 1:
        raise UsageError(f"--max-tokens-per-microbatch={args.max_tokens_per_microbatch}: must be >= 1.")
    if args.num_proc is not None and args.num_proc < 1:
        raise UsageError(f"--num-proc={args.num_proc}: must be >= 1.")
    for path in args.inputs:
        if input_format(path) is None:
            raise UsageError(f"{path}: unsupported input format; use {', '.join(sorted(FORMATS))} files.")


def _check_output(output: Path, *, overwrite: bool) -> Path:
    if output.exists() or output.is_symlink():
        if not output.is_dir() or output.is_symlink():
            raise UsageError(f"--output {output}: exists and is not a directory; choose another path.")
        entries = sorted(p.name for p in output.iterdir())
        if entries and not overwrite:
            raise UsageError(
                f"--output {output}: directory is not empty; pass --overwrite to replace a previous "
                "prepare-data output, or choose another path."
            )
        foreign = [name for name in entries if name not in OUTPUT_FILES]
        if foreign:
            raise UsageError(
                f"--output {output}: holds files that prepare-data did not write ({foreign[:3]}); "
                "refusing to replace it, choose another path."
            )
    return output


def _load_tokenizer(path: str) -> LoadedTokenizer:
    if not os.path.isdir(path):
        raise UsageError(f"--tokenizer {path}: not a directory; give a local tokenizer directory.")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # any loading failure is a bad --tokenizer argument
        raise UsageError(f"--tokenizer {path}: cannot load a tokenizer ({type(exc).__name__}: {exc}).") from exc
    if getattr(tokenizer, "eos_token_id", None) is None:
        raise UsageError(f"--tokenizer {path}: the tokenizer has no eos_token; set it in tokenizer_config.json.")
    template = getattr(tokenizer, "chat_template", None) or None
    tokenizer_json = Path(path, "tokenizer.json")
    template_text = template if isinstance(template, str) or template is None else json.dumps(template, sort_keys=True)
    info = {
        "name": os.path.basename(os.path.normpath(path)),
        "fingerprint": tokenizer_fingerprint(tokenizer),
        "tokenizer_json_sha256": sha256_file(tokenizer_json) if tokenizer_json.is_file() else None,
        "chat_template_sha256": None if template_text is None else hashlib.sha256(template_text.encode()).hexdigest(),
        "eos_token_id": int(tokenizer.eos_token_id),
    }
    return LoadedTokenizer(tokenizer=tokenizer, info=info)


def _read_all(args: argparse.Namespace, tokenizer: Any, candidates: Path) -> ReadResult:
    limits = {
        "max_length": args.max_length,
        "max_prompt_length": args.max_prompt_length,
        "max_tokens_per_microbatch": args.max_tokens_per_microbatch,
        "share_prompt": bool(args.share_prompt),
    }
    return read_inputs(
        list(args.inputs),
        tokenizer,
        limits,
        candidates,
        seed=args.seed,
        strict=args.strict,
        num_proc=resolve_num_proc(args.num_proc),
        progress=None if args.disable_tqdm else _progress_bar,
        apply_chat_template_to_strings=args.apply_chat_template_to_strings,
    )


def _progress_bar(name: str, total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=name, unit="row", file=sys.stderr)


def _select(groups: PromptGroups, read: ReadResult, args: argparse.Namespace) -> Selection:
    """The split of the candidates (their numbers, ascending), or the shortfall as a ``UsageError``."""
    valid = len(groups.group_of_row)
    train_size = args.train_size if args.train_size is not None else max(valid - args.eval_size, 0)
    train, eval_ = split_groups(groups.group_of_row, groups.keys, train_size=train_size, eval_size=args.eval_size)
    if len(train) < max(train_size, 1) or len(eval_) < args.eval_size:
        raise UsageError(_shortfall_message(args, read, groups))
    return Selection(train=np.sort(train), eval=np.sort(eval_))


def rejection_counts(counter: Counter[str]) -> str:
    """``": code=n, code=n"`` in code order (empty when nothing was rejected), for messages."""
    if not counter:
        return ""
    return ": " + ", ".join(f"{code}={counter[code]}" for code in sorted(counter))


def _shortfall_message(args: argparse.Namespace, read: ReadResult, groups: PromptGroups) -> str:
    valid, tally = len(groups.group_of_row), read.tally
    need = (args.train_size if args.train_size is not None else max(valid - args.eval_size, 1)) + args.eval_size
    if valid < need:
        rejected = sum(tally.rejections.values())
        hint = f" First rejection: {tally.first_rejection}" if tally.first_rejection else ""
        return (
            f"only {valid} valid pairs ({rejected} rows rejected{rejection_counts(tally.rejections)}), but "
            f"--train-size + --eval-size = {need}; lower the sizes or add data.{hint}"
        )
    prompts = groups.count()
    train = "the other" if args.train_size is None else str(args.train_size)
    return (
        f"{valid} valid pairs share {prompts} distinct prompts; grouped by prompt they cannot fill "
        f"{train} train + {args.eval_size} eval pairs without a prompt in both splits; "
        "lower the sizes."
    )


def _manifest(
    args: argparse.Namespace, read: ReadResult, tokenizer_info: dict[str, Any], split: Selection, groups: PromptGroups
) -> dict:
    from pair_dpo_trainer.version import __version__

    return {
        "format": MANIFEST_FORMAT,
        "package": {"name": "pair_dpo_trainer", "version": __version__},
        "inputs": [{"name": i.name, "sha256": i.sha256, "rows": i.rows} for i in read.inputs],
        "rows_read": sum(i.rows for i in read.inputs),
        "accepted": read.tally.num_accepted,
        "rejections": {code: read.tally.rejections[code] for code in sorted(read.tally.rejections)},
        "seed": args.seed,
        "train_size": len(split.train),
        "eval_size": args.eval_size,
        "max_length": args.max_length,
        "max_prompt_length": args.max_prompt_length,
        "max_tokens_per_microbatch": args.max_tokens_per_microbatch,
        "budget_share_prompt": bool(args.share_prompt),
        "apply_chat_template_to_strings": args.apply_chat_template_to_strings,
        "renderings": {name: read.tally.renderings[name] for name in sorted(read.tally.renderings)},
        "tokenizer": tokenizer_info,
        "splits": {
            name: {"pairs": len(rows), "prompts": groups.count(rows)}
            for name, rows in (("train", split.train), ("eval", split.eval))
        },
    }


@contextlib.contextmanager
def _staged(output: Path) -> Iterator[Path]:
    """A fresh sibling directory of ``output``, renamed to ``output`` when the block succeeds, removed when not."""
    parent = output.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = parent / f".{output.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
    except OSError as exc:
        raise UsageError(f"--output {output}: cannot create a directory next to it ({exc}).") from exc
    try:
        yield tmp
        _replace_dir(tmp, output)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UsageError(f"--output {output}: cannot write the outputs ({exc}).") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace_dir(tmp: Path, output: Path) -> None:
    """Moves ``tmp`` to ``output``; an existing (checked) ``output`` is removed only after success."""
    if not output.exists():
        os.rename(tmp, output)
        return
    backup = output.absolute().parent / f".{output.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
    os.rename(output, backup)
    try:
        os.rename(tmp, output)
    except OSError:
        os.rename(backup, output)
        raise
    shutil.rmtree(backup, ignore_errors=True)
