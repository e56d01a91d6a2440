"""A suite's runs as exact command lines (``argv`` lists): what ``run.py`` executes and ``--dry-run`` prints.

Python tools start as ``python -m MODULE`` (or ``train.py``) under the run's launcher: ``accelerate launch
--config_file C --num_processes N --main_process_port P [-m]``, ``torch.distributed.run --nproc_per_node N
--master_port P``, or DeepSpeed's launcher ``--num_gpus N --master_port P [--module]``; each multi-process run gets
its own port (:data:`BASE_PORT` + its index). The suite's and the run's ``env`` become an ``env`` prefix
(``-KEY`` unsets).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

from benchmarks.spec import Run, Suite

BASE_PORT = 29610
MODULES = {"ours": "benchmarks.dpo", "trl": "benchmarks.trl_dpo", "pytest": "pytest"}


def _target(run: Run, context: Mapping[str, str]) -> tuple[bool, list[str]]:
    """``(is_module, [module-or-script, args...])`` of a run, placeholders filled in."""
    args = [a.format_map(context) for a in run.args]
    if run.tool == "train":
        return False, ["train.py", *args, "--output_dir", f"{context['work']}/{run.tag}"]
    if run.tool == "module":
        return True, args
    if run.tool not in MODULES:
        raise ValueError(f"run {run.tag!r}: unknown tool {run.tool!r}")
    return True, [MODULES[run.tool], *args]


def _launcher(run: Run, port: int, is_module: bool, context: Mapping[str, str]) -> list[str]:
    """The launcher's argv up to (not including) the module or script."""
    python = sys.executable
    if run.launcher == "python":
        return [python, "-m"] if is_module else [python]
    if run.launcher == "accelerate":
        config = (run.config or "").format_map(context)
        head = [python, "-m", "accelerate.commands.launch", "--config_file", config]
        head += ["--num_processes", str(run.processes), "--main_process_port", str(port)]
        return [*head, "-m"] if is_module else head
    if run.launcher == "torchrun":
        head = [python, "-m", "torch.distributed.run", "--nproc_per_node", str(run.processes), "--master_port"]
        return [*head, str(port), "-m"] if is_module else [*head, str(port)]
    if run.launcher == "deepspeed":
        head = [python, "-m", "deepspeed.launcher.runner", "--num_gpus", str(run.processes), "--master_port"]
        return [*head, str(port), "--module"] if is_module else [*head, str(port)]
    raise ValueError(f"run {run.tag!r}: unknown launcher {run.launcher!r}")


def _env_prefix(env: tuple[str, ...]) -> list[str]:
    """``("A=1", "-B")`` -> ``["env", "-u", "B", "A=1"]`` (empty when there is nothing to set)."""
    if not env:
        return []
    unset = [x for item in env if item.startswith("-") for x in ("-u", item[1:])]
    return ["env", *unset, *(item for item in env if not item.startswith("-"))]


def command(run: Run, index: int, context: Mapping[str, str], suite_env: tuple[str, ...] = ()) -> list[str]:
    """The exact argv of the ``index``-th run of a suite (the suite's env first, then the run's own)."""
    is_module, target = _target(run, context)
    env = _env_prefix((*suite_env, *run.env))
    return [*env, *_launcher(run, BASE_PORT + index, is_module, context), *target]


def commands(suite: Suite, context: Mapping[str, str]) -> list[tuple[Run, list[str]]]:
    """Every run of ``suite`` with its argv, in order."""
    return [(run, command(run, i, context, suite.env)) for i, run in enumerate(suite.runs)]


def produced_tags(run: Run) -> list[str]:
    """The ratio operands a run's rows answer to: ``TAG`` (its main row), and for ``ours`` with ``--ceiling``
    ``TAG:pair_dpo_ceiling``, with ``--ceiling-shape S`` ``TAG_ceilingS:pair_dpo_ceiling_shape``."""
    tags = [run.tag]
    if run.tool == "ours" and "--ceiling" in run.args:
        tags.append(f"{run.tag}:pair_dpo_ceiling")
    if run.tool == "ours" and "--ceiling-shape" in run.args:
        shape = run.args[run.args.index("--ceiling-shape") + 1]
        tags.append(f"{run.tag}_ceiling{shape}:pair_dpo_ceiling_shape")
    return tags


def problems(suite: Suite) -> list[str]:
    """What is wrong with a suite's data: duplicate tags, ratios naming rows no run produces, curves of unknown
    ``train`` runs. Empty when the suite is sound."""
    tags = [run.tag for run in suite.runs]
    found = [f"duplicate tag {t!r}" for t in sorted({t for t in tags if tags.count(t) > 1})]
    known = {t for run in suite.runs for t in produced_tags(run)}
    for num, den in (*suite.ratios, *suite.memory_ratios):
        found += [f"ratio operand {x!r} is produced by no run" for x in (num, den) if x not in known]
    trains = {run.tag for run in suite.runs if run.tool == "train"}
    for curves in suite.curves:
        found += [f"curves name {t!r}, not a train run" for t in curves.tags if t not in trains]
    return found
