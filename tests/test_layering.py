"""The package's layers: imports point down :data:`LAYERS` only, no module imports a layer above its own, there is no
import cycle, and ``config/`` imports nothing of the package but ``errors``.

Every import counts: module level, inside functions, and under ``TYPE_CHECKING`` (a type-only import is still a
dependency of the design). ``from pkg import name`` counts as an import of ``pkg.name`` when that is a module, and a
module's own ancestor packages are not counted (Python runs them first anyway).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pair_dpo_trainer"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("__init__",),  # the public facade: PairDPOConfig and PairDPOTrainer, imported lazily
    ("testing",),  # helpers for tests only: no layer imports them
    ("trainer",),
    ("cli",),
    ("training",),
    ("observability",),
    ("fault_tolerance",),
    ("reference",),
    ("parallel",),
    ("modeling",),
    ("losses",),
    ("collators",),
    ("samplers",),
    ("data",),
    ("demo",),
    ("integrity",),
    ("config",),
    ("version", "atomic", "stop_signals"),
    ("errors",),
)
"""Top to bottom: a module may import its own layer's package and the layers below it, never one above."""

CONFIG_MAY_IMPORT = {"pair_dpo_trainer.errors"}
"""``config/`` is a leaf: besides itself, only the error types every layer shares."""


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The package modules one import statement names."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".")
            if MODULES[module].name != "__init__.py":
                base = base[:-1]
            base = base[: len(base) - node.level + 1]
            source = ".".join([*base, *([node.module] if node.module else [])])
        else:
            source = node.module or ""
        submodules = [f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in MODULES]
        names = submodules if len(submodules) == len(node.names) else [source, *submodules]
    return [resolved for name in names if name.split(".")[0] == PACKAGE.name and (resolved := _resolve(name))]


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _imported(module, node):
                    if target != module and not module.startswith(target + "."):  # itself, or an ancestor package
                        graph[module].add(target)
    return graph


GRAPH = _graph()


def _layer(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    for index, layer in enumerate(LAYERS):
        if top in layer:
            return index
    raise AssertionError(f"{module}: its top-level name {top!r} is in no layer of LAYERS (add it)")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(set(graph) | {target for targets in graph.values() for target in targets}):
        if module not in index:
            visit(module)
    return found


def test_every_module_is_in_a_layer():
    for module in MODULES:
        _layer(module)


def test_no_module_imports_a_layer_above_its_own():
    upward = [
        f"{module} -> {target}"
        for module, targets in sorted(GRAPH.items())
        for target in sorted(targets)
        if _layer(target) < _layer(module)
    ]
    assert upward == []


def test_there_is_no_import_cycle():
    assert _cycles(GRAPH) == []


def test_the_config_is_a_leaf():
    config = {module for module in MODULES if module.split(".")[:2] == ["pair_dpo_trainer", "config"]}
    outside = {f"{module} -> {target}" for module in config for target in GRAPH[module] - config - CONFIG_MAY_IMPORT}
    assert outside == set()


def test_the_top_level_holds_at_most_six_modules():
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= 6, top


def test_the_checker_sees_what_it_must():
    """The walk itself: a cycle and an upward import are found when they exist."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert "pair_dpo_trainer.errors" in GRAPH["pair_dpo_trainer.config.arguments"]
    assert "pair_dpo_trainer.modeling.logprobs" in GRAPH["pair_dpo_trainer.reference.deepspeed"]
    assert _layer("pair_dpo_trainer.reference.deepspeed") < _layer("pair_dpo_trainer.modeling.logprobs")


@pytest.mark.parametrize("doc", ["docs/architecture.md"])
def test_the_architecture_doc_draws_these_layers(doc):
    text = (ROOT / doc).read_text(encoding="utf-8")
    table = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    drawn = [
        re.findall(r"`([a-z_]+)(?:/|\.py)?`", line.split("|")[1])
        for line in table.splitlines()
        if line.startswith("| `")
    ]
    assert [tuple(names) for names in drawn] == [layer for layer in LAYERS if layer != ("__init__",)]


def test_every_package_folder_says_what_lives_there_and_what_it_may_import():
    """Each README's head (what comes before its "## Module notes") fits on a screen and says what may be imported."""
    folders = [PACKAGE, *sorted(path.parent for path in PACKAGE.glob("*/__init__.py"))]
    assert len(folders) > 1
    for folder in folders:
        readme = folder / "README.md"
        assert readme.is_file(), f"{folder.name}/ has no README.md"
        head = readme.read_text(encoding="utf-8").split("\n## Module notes\n", 1)[0]
        assert "May import:" in head and 3 <= len(head.strip().splitlines()) <= 12, folder.name


CONFIG_HOLDERS: dict[str, str] = {
    "pair_dpo_trainer.config": "the config itself: its fields, range checks and the sections' from_config builders",
    "pair_dpo_trainer.trainer": "orchestration: hands each feature its section (and HF's Trainer owns self.args)",
    "pair_dpo_trainer.training.options": "the option collection: builds every section once, decides uses_reference",
    "pair_dpo_trainer.training.checks": "the option collection of the checks: gives each feature check its section",
    "pair_dpo_trainer.observability.summary": "the run summary: prints the options as the user gave them",
    "pair_dpo_trainer.training.resume_settings": "records named options in each checkpoint and passes the arguments "
    "to HF's TrainerState.compute_steps, which takes TrainingArguments",
}
"""Modules (and their submodules) that may take or hold the whole ``PairDPOConfig`` / ``TrainingArguments``, and why.
Every other feature receives its section (``config/sections.py``, built by ``training/options.py``) or keyword
arguments, as CONTRIBUTING.md asks."""

HF_TRAINER_READERS: dict[str, str] = {
    "pair_dpo_trainer.fault_tolerance.checkpoint": "writes HF's Trainer checkpoint: reads HF's own fields "
    "(ranks, should_save, save_total_limit) from trainer.args, never a PairDPOConfig option",
}
"""Modules that read ``trainer.args`` of HF's Trainer, for HF's own ``TrainingArguments`` fields only."""

EXCEPTION_ARGS = {"pair_dpo_trainer.errors"}
"""Where ``<x>.args`` is an exception's (``BaseException.args``), not the trainer's arguments."""

CONFIG_TYPES = ("PairDPOConfig", "TrainingArguments")
CONFIG_NAMES = ("args", "config")


def _pair_dpo_options() -> set[str]:
    """The names ``PairDPOConfig`` itself declares (fields and properties), read from its class body."""
    tree = ast.parse((PACKAGE / "config" / "arguments.py").read_text(encoding="utf-8"))
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "PairDPOConfig").body
    fields = {node.target.id for node in body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    return fields | {node.name for node in body if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")}


PAIR_DPO_OPTIONS = _pair_dpo_options()


def _holds_config(module: str, table: dict[str, str]) -> bool:
    return any(module == name or module.startswith(name + ".") for name in table)


def _is_hf_callback_hook(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """``on_<event>(self, args, state, control, ...)``: HF's ``TrainerCallback`` API hands every hook its arguments."""
    names = [param.arg for param in function.args.args[:4]]
    return function.name.startswith("on_") and names == ["self", "args", "state", "control"]


def _option_reads(node: ast.AST, holder: str) -> set[str]:
    """The ``PairDPOConfig`` options read as ``holder.<option>`` or ``<x>.holder.<option>`` inside ``node``."""
    return {
        attribute.attr
        for attribute in ast.walk(node)
        if isinstance(attribute, ast.Attribute)
        and attribute.attr in PAIR_DPO_OPTIONS
        and (
            (isinstance(attribute.value, ast.Name) and attribute.value.id == holder)
            or (isinstance(attribute.value, ast.Attribute) and attribute.value.attr == holder)
        )
    }


def _config_takers(module: str, tree: ast.AST) -> list[str]:
    """Where a module outside :data:`CONFIG_HOLDERS` takes or holds the whole config.

    A parameter counts when its annotation names ``PairDPOConfig`` / ``TrainingArguments``, or when it is named
    ``args`` / ``config`` without another annotation (none, or ``Any``); an attribute counts when it is ``<x>.args``
    (the trainer's arguments). Exempt: an HF callback hook's ``args`` that reads no ``PairDPOConfig`` option, and
    ``trainer.args`` in :data:`HF_TRAINER_READERS` for HF's own fields.
    """
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args
            for param in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]:
                annotation = ast.unparse(param.annotation) if param.annotation is not None else ""
                typed = any(name in annotation for name in CONFIG_TYPES)
                named = param.arg in CONFIG_NAMES and annotation in ("", "Any")
                if not (typed or named):
                    continue
                if _is_hf_callback_hook(node) and param.arg == "args" and not typed:
                    read = _option_reads(node, "args")
                    if read:
                        found.append(f"{module}:{node.lineno} {node.name}() hook reads {sorted(read)} of args")
                    continue
                found.append(
                    f"{module}:{node.lineno} {node.name}({param.arg}{': ' + annotation if annotation else ''})"
                )
        elif isinstance(node, ast.Attribute) and node.attr == "args" and module not in EXCEPTION_ARGS:
            if not (_holds_config(module, HF_TRAINER_READERS) and ast.unparse(node) == "trainer.args"):
                found.append(f"{module}:{node.lineno} {ast.unparse(node)}")
    if _holds_config(module, HF_TRAINER_READERS):
        read = _option_reads(tree, "args")
        found.extend(f"{module}: reads PairDPOConfig option {name} of trainer.args" for name in sorted(read))
    return found


def test_only_the_option_collection_takes_the_whole_config():
    """A feature receives the few options it reads (its section of ``config/sections.py`` or keyword arguments),
    never the whole ``PairDPOConfig``: only the modules of :data:`CONFIG_HOLDERS` take or hold it."""
    takers = [
        taker
        for module, path in sorted(MODULES.items())
        if not _holds_config(module, CONFIG_HOLDERS)
        for taker in _config_takers(module, ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert takers == []


def test_the_config_taker_check_sees_what_it_must():
    """The check itself: each form of taking the config is found, a section or HF's hook signature is not."""
    source = """
def typed(options: PairDPOConfig): ...
def hf(arguments: "TrainingArguments"): ...
def named(args): ...
def named_any(config: Any): ...
def section(layers: LayerOptions, *, device: str): ...
def cli(args: argparse.Namespace): ...
def stored(self, trainer): self.x = trainer.args
class Callback:
    def on_step_end(self, args, state, control, **kwargs): return args.process_index
    def on_log(self, args, state, control, **kwargs): return args.sync_ref_model
"""
    found = _config_takers("m", ast.parse(source))
    assert sorted(line.split(" ", 1)[1] for line in found) == sorted(
        [
            "typed(options: PairDPOConfig)",
            "hf(arguments: 'TrainingArguments')",
            "named(args)",
            "named_any(config: Any)",
            "trainer.args",
            "on_log() hook reads ['sync_ref_model'] of args",
        ]
    )
    assert {"max_length", "sync_ref_model", "pairs_per_rank_per_step"} <= PAIR_DPO_OPTIONS
    assert _holds_config("pair_dpo_trainer.config.sections", CONFIG_HOLDERS)
