"""``pair-dpo prepare-data``: the command line of :mod:`pair_dpo_trainer.data.prepare`.

``pair-dpo prepare-data INPUT [INPUT...] --output DIR --tokenizer PATH`` (every valid pair as train, none held out;
``--eval-size M`` holds out M pairs of whole prompt groups, ``--train-size N`` caps the train split). Errors print one
message on stderr and return exit code 2.
"""

from __future__ import annotations

import argparse
import sys

from pair_dpo_trainer.data.prepare import DEFAULT_SEED, UsageError, prepare, rejection_counts
from pair_dpo_trainer.data.readers import InputError
from pair_dpo_trainer.data.workers import MAX_NUM_PROC
from pair_dpo_trainer.errors import PairDPOError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Registers the ``prepare-data`` arguments on ``parser``."""
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="jsonl / json / parquet files of preference rows.")
    parser.add_argument("--output", required=True, metavar="DIR", help="Output directory (created atomically).")
    parser.add_argument(
        "--tokenizer",
        required=True,
        metavar="PATH",
        help="Local tokenizer directory: conversations are rendered with its chat template, plain strings as raw text.",
    )
    parser.add_argument(
        "--train-size",
        type=int,
        default=None,
        metavar="N",
        help="Train pairs to select (>= 1; default: every valid pair not held out for eval).",
    )
    parser.add_argument(
        "--eval-size",
        type=int,
        default=0,
        metavar="M",
        help="Eval pairs to hold out, whole prompt groups (default 0: no eval split).",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=DEFAULT_SEED,
        metavar="S",
        help=f"Seed of the deterministic selection (default {DEFAULT_SEED}, the trainer's default seed: "
        "--eval-size 200 holds out the pairs train.py --dataset FILE holds out).",
    )
    _add_limit_arguments(parser)
    _add_run_arguments(parser)


def _add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """The length limits, the rendering of plain strings and the micro-batch budget."""
    parser.add_argument(
        "--max-length",
        type=int,
        default=1024,
        metavar="L",
        help="Maximum tokens of prompt + one completion (default 1024).",
    )
    parser.add_argument(
        "--max-prompt-length",
        type=int,
        default=None,
        metavar="P",
        help="Maximum prompt tokens, left-truncated (must be < --max-length; default as the trainer's: 512, or "
        "--max-length // 2 when --max-length <= 512).",
    )
    parser.add_argument(
        "--apply-chat-template-to-strings",
        action="store_true",
        help="Render plain-string rows with the tokenizer's chat template (one user turn, one assistant turn) "
        "instead of as raw text (TRL's way); train with apply_chat_template_to_strings=True then.",
    )
    parser.add_argument(
        "--max-tokens-per-microbatch",
        type=int,
        default=None,
        metavar="T",
        help="Reject pairs costing more than T tokens (2 x prompt + chosen + rejected; prompt + chosen + rejected "
        "with --share-prompt): the token budget of one micro-batch you will train with "
        "(PairDPOConfig.max_tokens_per_microbatch).",
    )
    parser.add_argument(
        "--share-prompt",
        action="store_true",
        help="Count each prompt once against --max-tokens-per-microbatch: the shared-prompt layout the trainer packs "
        "where the model supports it (PairDPOConfig.share_prompt). The run checks its budget in its own layout.",
    )


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """How the conversion runs: strictness, workers, progress, overwriting."""
    parser.add_argument(
        "--strict",
        action="store_true",
        help="Fail on the first rejected row (a malformed JSON line too) instead of counting it.",
    )
    parser.add_argument(
        "--num-proc",
        type=int,
        default=None,
        metavar="W",
        help=f"Worker processes that tokenise (default: the usable cores, at most {MAX_NUM_PROC}); the outputs are "
        "byte-identical for any W.",
    )
    parser.add_argument(
        "--disable-tqdm", action="store_true", help="Show no progress bar (default: one per input file, on stderr)."
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="Replace an existing DIR that holds only a previous prepare-data output.",
    )


def run(args: argparse.Namespace) -> int:
    """Runs ``prepare-data``; returns 0 on success, 2 (with a message on stderr) on a usage or input error."""
    try:
        report = prepare(args)
    except (UsageError, InputError, PairDPOError) as exc:
        print(f"pair-dpo prepare-data: error: {exc}", file=sys.stderr)
        return 2
    tally = report.tally
    print(
        f"read {tally.num_rows} rows from {report.num_inputs} input(s); accepted {tally.num_accepted}; "
        f"rejected {sum(tally.rejections.values())}{rejection_counts(tally.rejections)}"
    )
    for code in sorted(tally.examples):
        print(f"  e.g. [{code}] {tally.examples[code]}")
    print(f"wrote {report.num_train} train + {report.num_eval} eval pairs to {args.output}")
    if not args.disable_tqdm:
        print(
            f"tokenised {report.rate} on {report.workers} worker(s); split in {report.split_seconds:.2f} s; "
            f"wrote the splits in {report.write_seconds:.2f} s",
            file=sys.stderr,
        )
    return 0
