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
