"""Training curves (loss, reward margin, reward accuracy against step; train and eval) from ``trainer_state.json``.

Also the ``pair-dpo plot OUTPUT_DIR`` subcommand.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

PANELS = (("loss", "loss"), ("rewards/margins", "reward margin"), ("rewards/accuracies", "reward accuracy"))
CURVES_FILENAME = "training_curves.png"


def _series(log_history: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(entry["step"], float(entry[key])) for entry in log_history if key in entry and "step" in entry]
    return [s for s, _ in points], [v for _, v in points]


def plot_training_curves(log_history: list[dict], path: str | Path) -> Path:
    """Draws one panel per metric with the train and eval curves and saves a PNG.

    Args:
        log_history: ``TrainerState.log_history`` (list of dicts with ``step`` and metric keys; eval keys are
            prefixed ``eval_``).
        path: Output PNG path.

    Returns:
        The written path.
    """
    import matplotlib.pyplot as plt

    fig = curves_figure(log_history)
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def curves_figure(log_history: list[dict]) -> Any:
    """The figure of :func:`plot_training_curves` (matplotlib's ``Agg`` backend). Each axis writes its values in full:
    a nearly flat curve (a loss at ln 2 for a few steps) is labelled ``0.69314``, never ``1e-5+6.931e-1``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.6), constrained_layout=True)
    for ax, (key, title) in zip(axes, PANELS, strict=True):
        for label, prefix, style in (("train", "", "-"), ("eval", "eval_", "o-")):
            steps, values = _series(log_history, prefix + key)
            if steps:
                ax.plot(steps, values, style, label=label, markersize=3)
        ax.ticklabel_format(axis="y", useOffset=False)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a run too short to log a metric has nothing to label
            ax.legend()
    return fig


def plot_run(output_dir: str | Path) -> tuple[Path, Path]:
    """Plots ``OUTPUT_DIR/trainer_state.json`` (or the newest checkpoint's) into ``OUTPUT_DIR/training_curves.png``;
    returns ``(the state file read, the PNG written)``."""
    root = Path(output_dir)
    state_path = root / "trainer_state.json"
    if not state_path.is_file():
        checkpoints = sorted(
            root.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[1])
        )
        if not checkpoints:
            raise FileNotFoundError(f"no trainer_state.json in {root} or its checkpoint-* folders")
        state_path = checkpoints[-1]
    log_history = json.loads(state_path.read_text())["log_history"]
    return state_path, plot_training_curves(log_history, root / CURVES_FILENAME)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``pair-dpo plot``."""
    parser.add_argument("output_dir", help="A run's output directory (holding trainer_state.json).")


def run(args: argparse.Namespace) -> int:
    """Runs ``pair-dpo plot``; exit 0 on success, 2 when there is nothing to plot."""
    try:
        state_path, path = plot_run(args.output_dir)
    except (FileNotFoundError, KeyError, json.JSONDecodeError) as exc:
        print(f"pair-dpo plot: {exc}", file=sys.stderr)
        return 2
    panels = ", ".join(title for _, title in PANELS)
    print(f"pair-dpo plot: wrote {path} ({panels} against step, from {state_path})")
    return 0
