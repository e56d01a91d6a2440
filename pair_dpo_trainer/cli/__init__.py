"""The ``pair-dpo`` command line: one subcommand per module, imported lazily.

A reason-coded error (:class:`~pair_dpo_trainer.errors.PairDPOError`) is printed as its one message on stderr with
exit code 1, here and in ``train.py`` (:func:`report_errors`); ``--debug`` (or ``PAIR_DPO_DEBUG=1``) shows the
traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence

from pair_dpo_trainer.errors import PairDPOError
from pair_dpo_trainer.fault_tolerance.preemption import stop_on_signal

# subcommand -> module that defines ``add_arguments(parser)`` and ``run(args) -> int``.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "prepare-data": ("pair_dpo_trainer.cli.prepare_data", "Normalise, tokenise and split preference data."),
    "verify-snapshot": ("pair_dpo_trainer.cli.verify_snapshot", "Verify a snapshot against its pinned commit."),
    "pin": ("pair_dpo_trainer.cli.pin", "Pin a local model directory (e.g. after SFT) so it can be verified."),
    "plot": ("pair_dpo_trainer.cli.plot", "Draw training_curves.png from a run's trainer_state.json."),
}
DEBUG_VARIABLE = "PAIR_DPO_DEBUG"
"""Set to 1 to see the traceback of a reason-coded error (``train.py``, ``pair-dpo``)."""


def debugging() -> bool:
    """True when ``PAIR_DPO_DEBUG`` asks for tracebacks."""
    return os.environ.get(DEBUG_VARIABLE, "").strip().lower() not in ("", "0", "false", "no")


def report_errors(prog: str, work: Callable[[], int], *, debug: bool = False) -> int:
    """Runs ``work`` and returns its exit code; a reason-coded error becomes one message on stderr and exit code 1.

    Args:
        prog: The program name the message starts with (``train.py``, ``pair-dpo prepare-data``).
        work: The program's body; returns its exit code.
        debug: Re-raise the error (its traceback) instead; also with ``PAIR_DPO_DEBUG=1``.
    """
    try:
        return work()
    except PairDPOError as exc:
        if debug or debugging():
            raise
        print(f"{prog}: error: {exc}\n{prog}: (the traceback: set {DEBUG_VARIABLE}=1)", file=sys.stderr, flush=True)
        return 1


def build_parser() -> argparse.ArgumentParser:
    """Builds the top-level parser with every registered subcommand."""
    parser = argparse.ArgumentParser(prog="pair-dpo", description="pair_dpo_trainer command line tools.")
    parser.add_argument(
        "--debug", action="store_true", help=f"Show the traceback of an error (also: {DEBUG_VARIABLE}=1)."
    )
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
    module = importlib.import_module(args._module)
    with stop_on_signal(f"pair-dpo {args.command}"):  # SIGTERM / Ctrl-C: exit 75, partial outputs removed
        return report_errors(f"pair-dpo {args.command}", lambda: int(module.run(args)), debug=args.debug)
