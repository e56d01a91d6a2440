"""The ``pair-dpo`` command line: one subcommand per module, imported lazily."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

from pair_dpo_trainer.fault_tolerance.preemption import stop_on_signal

# subcommand -> module that defines ``add_arguments(parser)`` and ``run(args) -> int``.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "prepare-data": ("pair_dpo_trainer.cli.prepare_data", "Normalise, tokenise and split preference data."),
    "verify-snapshot": ("pair_dpo_trainer.cli.verify_snapshot", "Verify a snapshot against its pinned commit."),
    "pin": ("pair_dpo_trainer.cli.pin", "Pin a local model directory (e.g. after SFT) so it can be verified."),
    "plot": ("pair_dpo_trainer.cli.plot", "Draw training_curves.png from a run's trainer_state.json."),
}


def build_parser() -> argparse.ArgumentParser:
    """Builds the top-level parser with every registered subcommand."""
    parser = argparse.ArgumentParser(prog="pair-dpo", description="pair_dpo_trainer command line tools.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(_module=module_name)
        importlib.import_module(module_name).add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pair-dpo`` console script; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    with stop_on_signal(f"pair-dpo {args.command}"):  # SIGTERM / Ctrl-C: exit 75, partial outputs removed
        return int(importlib.import_module(args._module).run(args))
