"""``pair-dpo pin DIR``: pin a local model directory so it verifies like a Hub download.

The pinning itself is :func:`pair_dpo_trainer.integrity.pin.pin_snapshot`; this is its command line.
"""

from __future__ import annotations

import argparse

from pair_dpo_trainer.cli.verify_snapshot import positive_int, run_snapshot_command
from pair_dpo_trainer.integrity.hashing import ProgressFn
from pair_dpo_trainer.integrity.pin import pin_snapshot
from pair_dpo_trainer.integrity.snapshot import VerifiedSnapshot


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the ``pin`` arguments to ``parser``."""
    parser.add_argument("path", help="A local model directory, e.g. the output of save_pretrained after SFT.")
    parser.add_argument(
        "--force", action="store_true", help="Replace existing download metadata (a Hub download's or a pin's)."
    )
    parser.add_argument("--json", action="store_true", dest="as_json", help="Print one JSON object on stdout.")
    parser.add_argument(
        "--allow-pickle", action="store_true", help="Accept .bin (pickle) weights when no safetensors exist."
    )
    parser.add_argument("--threads", type=positive_int, default=None, help="Hashing threads (default: one per core).")


def run(args: argparse.Namespace) -> int:
    """Runs ``pin``; returns 0 (pinned, the revision printed) or 1 (refused, the reason code printed)."""

    def pin(progress: ProgressFn) -> VerifiedSnapshot:
        return pin_snapshot(
            args.path, threads=args.threads, allow_pickle=args.allow_pickle, force=args.force, progress=progress
        )

    def detail(snapshot: VerifiedSnapshot) -> str:
        return (
            f"train against it with: --ref_model_revision {snapshot.revision}\n"
            f'  (PairDPOConfig(ref_model_revision="{snapshot.revision}")); a later change to the directory is refused.'
        )

    return run_snapshot_command(pin, as_json=args.as_json, done="PINNED", refused="REFUSED", detail=detail)
