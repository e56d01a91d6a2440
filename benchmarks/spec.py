"""The data types of a benchmark suite (``suites.py`` lists them; ``run.py`` plans and runs them).

A :class:`Suite` is a list of :class:`Run` s (each with a tag, unique in the suite), the ratios between their rows that
the report prints, and optional set-up steps (:class:`Setup`: a random pinned snapshot, a DeepSpeed-config variant)
and loss-curve comparisons of ``train.py`` runs (:class:`Curves`). Arguments may name ``{work}`` (the suite's scratch
directory), ``{out}`` (where results land) and what a set-up step defines (``{rev}``: the snapshot's revision,
``{NAME}``: a set-up step's output path), filled in by the runner.
"""

from __future__ import annotations

from dataclasses import dataclass

TOOLS = ("ours", "trl", "train", "pytest", "module")
"""What a run starts: ``ours`` ``benchmarks.dpo``; ``trl`` ``benchmarks.trl_dpo`` (skipped without trl); ``train``
the repository's ``train.py`` (``--output_dir {work}/TAG`` added, its trainer_state.json copied to
``{out}/state_TAG.json``); ``pytest``; ``module`` the module named by the first argument."""
LAUNCHERS = ("python", "accelerate", "torchrun", "deepspeed")


@dataclass(frozen=True)
class Run:
    """One process tree: ``tool`` with ``args`` under ``launcher``, its output appended to ``{out}/LOG``.

    ``timeout_s`` caps the run (and the suite's deadline cuts it further); ``env`` entries are ``KEY=VALUE`` (set) or
    ``-KEY`` (unset) for this run only; ``config`` is the accelerate config file (launcher ``accelerate``).
    """

    tag: str
    tool: str = "ours"
    args: tuple[str, ...] = ()
    launcher: str = "python"
    config: str | None = None
    processes: int = 1
    timeout_s: int = 120
    env: tuple[str, ...] = ()
    log: str = "bench.log"


@dataclass(frozen=True)
class Setup:
    """A step before the runs. ``random_model``: ``benchmarks.tools.random_model --out {work}/NAME ARGS`` (defines
    ``{NAME}`` and ``{rev}``); ``zero3_variant``: ``accelerate_configs/zero3_overlap.{json,yaml}`` with
    ``zero_optimization[ARGS[0]] = json(ARGS[1])`` written to ``{work}/NAME.{json,yaml}`` (defines ``{NAME}``, the
    yaml)."""

    kind: str
    name: str
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Curves:
    """After the runs: the loss curves of ``train`` runs ``tags`` overlaid in ``{out}/PNG`` (largest difference from
    the first run printed), via ``benchmarks.tools.loss_curves``."""

    tags: tuple[str, ...]
    labels: tuple[str, ...]
    png: str
    key: str = "loss"


@dataclass(frozen=True)
class Suite:
    """A named list of runs for one machine kind (``gpus``), capped by ``deadline_s`` for the whole suite."""

    name: str
    summary: str
    gpus: int
    deadline_s: int
    runs: tuple[Run, ...]
    ratios: tuple[tuple[str, str], ...] = ()
    memory_ratios: tuple[tuple[str, str], ...] = ()
    setup: tuple[Setup, ...] = ()
    curves: tuple[Curves, ...] = ()
    env: tuple[str, ...] = ()
    look_for: str = ""


def ours(tag: str, *args: str, **kw) -> Run:
    """A ``benchmarks.dpo`` run with ``--tag TAG`` first."""
    return Run(tag=tag, tool="ours", args=("--tag", tag, *args), **kw)


def trl(tag: str, *args: str, **kw) -> Run:
    """A ``benchmarks.trl_dpo`` run with ``--tag TAG`` first."""
    return Run(tag=tag, tool="trl", args=("--tag", tag, *args), **kw)


def train(tag: str, *args: str, **kw) -> Run:
    """A ``train.py`` run (output directory ``{work}/TAG``)."""
    return Run(tag=tag, tool="train", args=args, **kw)


def ratios(*pairs: str) -> tuple[tuple[str, str], ...]:
    """``ratios("a/b", "c/d")`` -> ``(("a", "b"), ("c", "d"))``; an operand is ``TAG`` or ``TAG:IMPL``."""
    return tuple(tuple(p.split("/")) for p in pairs)  # type: ignore[misc]
