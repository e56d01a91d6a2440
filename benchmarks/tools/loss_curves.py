#!/usr/bin/env python
"""Overlay the training-loss curves of several runs (e.g. DP=1 vs DP=2, straight vs resumed) in one PNG.

Usage::

    python -m benchmarks.tools.loss_curves A/trainer_state.json B/trainer_state.json --out docs/img/dp1_vs_dp2.png
    python -m benchmarks.tools.loss_curves runs/dp1 runs/dp2 --labels "DP=1" "DP=2" --out cmp.png --key loss

Each argument is a ``trainer_state.json`` or a run directory (its ``trainer_state.json``, else the newest
``checkpoint-*/trainer_state.json``). The left panel overlays the curves; the right one shows each run's absolute
difference from the first run at the steps both logged. The largest difference per run is also printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``argv`` without the program name; None reads ``sys.argv``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="trainer_state.json files or run directories")
    parser.add_argument("--out", type=Path, required=True, help="output PNG")
    parser.add_argument("--labels", nargs="+", default=None, help="one legend label per run (default: paths)")
    parser.add_argument("--key", default="loss", help="logged metric to plot (default: the training loss)")
    return parser.parse_args(argv)


def state_file(path: Path) -> Path:
    """The ``trainer_state.json`` a run argument refers to.

    Raises:
        FileNotFoundError: No state file there.
    """
    if path.is_file():
        return path
    if (path / "trainer_state.json").is_file():
        return path / "trainer_state.json"
    checkpoints = sorted(path.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[1]))
    if not checkpoints:
        raise FileNotFoundError(f"no trainer_state.json in {path} or its checkpoint-* folders")
    return checkpoints[-1]


def series(path: Path, key: str) -> dict[int, float]:
    """Step -> value of ``key`` from a run's ``log_history`` (the last value logged at a step wins)."""
    history = json.loads(state_file(path).read_text())["log_history"]
    return {int(entry["step"]): float(entry[key]) for entry in history if key in entry and "step" in entry}


def plot(curves: dict[str, dict[int, float]], key: str, out: Path) -> dict[str, float]:
    """Draws the overlay and difference panels; returns each run's max |difference| from the first run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), constrained_layout=True)
    labels = list(curves)
    base = curves[labels[0]]
    worst: dict[str, float] = {}
    for index, label in enumerate(labels):
        steps = sorted(curves[label])
        left.plot(steps, [curves[label][s] for s in steps], "-" if index == 0 else "--", label=label)
        if index:
            shared = [s for s in steps if s in base]
            diffs = [abs(curves[label][s] - base[s]) for s in shared]
            worst[label] = max(diffs, default=float("nan"))
            right.semilogy(shared, [max(d, 1e-12) for d in diffs], ".-", label=f"{label} vs {labels[0]}")
    left.set_title(key)
    right.set_title(f"|{key} difference| (floor 1e-12)")
    for ax in (left, right):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return worst


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0 with the PNG written, 2 when a run has nothing to plot."""
    args = parse_args(argv)
    labels = args.labels or [str(run) for run in args.runs]
    if len(labels) != len(args.runs):
        print("plot_loss_curves: give one --labels entry per run", file=sys.stderr)
        return 2
    try:
        curves = {label: series(run, args.key) for label, run in zip(labels, args.runs, strict=True)}
    except (FileNotFoundError, KeyError, json.JSONDecodeError) as exc:
        print(f"plot_loss_curves: {exc}", file=sys.stderr)
        return 2
    empty = [label for label, curve in curves.items() if not curve]
    if empty:
        print(f"plot_loss_curves: no '{args.key}' logged in {empty}", file=sys.stderr)
        return 2
    for label, value in plot(curves, args.key, args.out).items():
        print(f"max |{args.key} difference| {label} vs {labels[0]}: {value:.3e}")
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
