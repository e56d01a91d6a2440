"""Docs that tests keep true: every reason code raised anywhere is documented, every documented code is raised, every
module is in docs/architecture.md or its folder's README.md, every module note sits beside its module (the docstring
examples run through ``--doctest-modules``, see setup.cfg)."""

from __future__ import annotations

import ast
import collections
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pair_dpo_trainer"
CODE = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)+$|^[a-z]+$")
COMPUTED = {"invalid_config", "environment_drift", "save_failed"}
"""Codes the package computes instead of spelling them in a raise: several problems at once
(``training.checks.raise_problems``), a probe-only identity difference (``ReferenceComparison.reason_code``), a failed
save
on another rank (``fault_tolerance.checkpoint``)."""


def _is_code(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and bool(CODE.match(node.value))


def _is_problem(node: ast.AST) -> bool:
    """A ``(code, ...)`` 2-tuple whose code has an underscore (``("bad_length", text)``)."""
    return isinstance(node, ast.Tuple) and len(node.elts) == 2 and _is_code(node.elts[0]) and "_" in node.elts[0].value


def _codes_in(tree: ast.AST) -> set[str]:
    """``reason_code`` literals: ``SomeError("code", message)``, ``code=`` / ``reason_code=`` arguments, the
    ``("code", message)`` problems of the collect-all checks and ``"[code] ..."`` device-assert messages."""
    codes: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name.endswith(("Error", "Preempted")) and len(node.args) >= 2 and _is_code(node.args[0]):
                codes.add(node.args[0].value)
            codes.update(k.value.value for k in node.keywords if k.arg in ("code", "reason_code") and _is_code(k.value))
        elif (
            isinstance(node, ast.Tuple) and len(node.elts) == 2 and _is_code(node.elts[0]) and "_" in node.elts[0].value
        ):
            code, message = node.elts  # type: ignore[attr-defined]
            same_name = isinstance(message, ast.Name) and message.id == code.value  # ("option", option)
            if isinstance(message, (ast.JoinedStr, ast.BinOp, ast.Name)) and not same_name:  # not ("col", pa.int64())
                codes.add(code.value)
            elif isinstance(message, ast.Constant) and isinstance(message.value, str) and " " in message.value:
                codes.add(code.value)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = re.match(r"^\[([a-z][a-z0-9_]+)\] ", node.value)
            if match:
                codes.add(match.group(1))
    return codes


def raised_codes() -> set[str]:
    from pair_dpo_trainer.errors import SNAPSHOT_FIXES

    sources = [*PACKAGE.rglob("*.py"), ROOT / "train.py"]
    codes = set().union(*(_codes_in(ast.parse(path.read_text(), str(path))) for path in sources))
    return codes | set(SNAPSHOT_FIXES)  # the snapshot codes are raised through a variable, each with its fix


def documented_codes() -> set[str]:
    return set(re.findall(r"^\| `([a-z0-9_]+)` \|", (ROOT / "docs" / "reason_codes.md").read_text(), re.M))


def test_the_scan_finds_codes_raised_in_each_form() -> None:
    source = """
raise ConfigError("bad_beta", f"beta={beta}")
problems.append(("bad_length", "max_length=1: set a value > 1."))
problems.append(("bad_ref_zero_stage", problem))
require_model_directory(path, code="model_not_found")
torch._assert_async(ok, "[non_finite] a DPO loss is NaN")
for name, value in (("pad_to_length", pad_to_length),): pass
schema = pa.schema([("prompt_hash", pa.string())])
"""
    assert _codes_in(ast.parse(source)) == {
        "bad_beta",
        "bad_length",
        "bad_ref_zero_stage",
        "model_not_found",
        "non_finite",
    }


def test_every_raised_reason_code_is_documented() -> None:
    missing = raised_codes() - documented_codes()
    assert not missing, f"add these codes to docs/reason_codes.md: {sorted(missing)}"


def test_every_documented_reason_code_is_raised() -> None:
    stale = documented_codes() - raised_codes() - COMPUTED
    assert not stale, f"docs/reason_codes.md lists codes nothing raises: {sorted(stale)}"
    assert COMPUTED <= documented_codes()


def _names(text: str, name: str) -> bool:
    return re.search(r"(?<![\w/.])" + re.escape(name) + r"(?!\w)", text) is not None


def test_every_module_is_in_the_architecture_doc_or_its_folder_readme() -> None:
    """Named in docs/architecture.md by its path inside the package (``data/normalize.py``) or by its file name when
    that is unique, or by its file name in its own folder's README.md (the package's README.md for a top-level one)."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    modules = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"]
    names = collections.Counter(Path(m).name for m in modules)

    def described(module: str) -> bool:
        name = Path(module).name
        if _names(doc, module) or (names[name] == 1 and _names(doc, name)):
            return True
        readme = PACKAGE / Path(module).parent / "README.md"
        return readme.is_file() and _names(readme.read_text(encoding="utf-8"), name)

    missing = [m for m in sorted(modules) if not described(m)]
    assert not missing, f"describe these modules in docs/architecture.md or their folder's README.md: {missing}"


def test_every_module_note_sits_beside_its_module() -> None:
    """A README's "## Module notes" has one ``### `name.py` `` section per module of its own folder, and the module's
    docstring points there (so a renamed or removed module cannot leave a note behind)."""
    readmes = sorted(PACKAGE.rglob("README.md"))
    noted = 0
    for readme in readmes:
        parts = readme.read_text(encoding="utf-8").split("\n## Module notes\n", 1)
        for name in re.findall(r"^### `([^`]+)`$", parts[1] if len(parts) == 2 else "", re.M):
            module = readme.parent / name
            assert module.is_file(), f"{readme.relative_to(ROOT)}: a note of {name}, which is not in that folder"
            where = readme.relative_to(ROOT if readme.parent == PACKAGE else PACKAGE).as_posix()
            pointer = f'{where}, "Module notes", ``{name}``'
            assert pointer in " ".join(module.read_text(encoding="utf-8").split()), f"{module.name}: no {pointer!r}"
            noted += 1
    assert noted
    stale = [p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py") if "docs/architecture.md" in p.read_text()]
    assert not stale, f"module notes are in each folder's README.md, not docs/architecture.md: {stale}"


SUMMARY = re.compile(r"<!-- benchmark-summary:start -->\n.*?<!-- benchmark-summary:end -->", re.S)


def test_the_readme_quotes_the_benchmark_summary_and_its_headline_numbers_come_from_it() -> None:
    """README.md's speed table is docs/benchmarks.md's summary, character for character, and every number of its
    "Fast:" headline (ratios, tokens/s, GiB, MFU, scaling) is a cell of that table: the README cannot drift from the
    benchmark record."""
    summary = SUMMARY.findall((ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8"))
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(summary) == 1 and SUMMARY.findall(readme) == summary
    cells = {cell.strip() for row in summary[0].splitlines() for cell in row.split("|")}
    cell_text = " ".join(cells)
    headline = re.search(r"^- Fast: (.*?)(?=^- |^#|\n\n)", readme, re.S | re.M)
    assert headline is not None
    numbers = re.findall(r"~?\d[\d,]*(?:\.\d+)?(?:x|%|k|B)?", headline.group(1))
    assert len(numbers) >= 8, numbers
    missing = [
        number for number in numbers if not re.search(rf"(?<![\d.,]){re.escape(number)}(?!\d|,\d|\.\d)", cell_text)
    ]
    assert not missing, f"README's headline numbers not in the benchmark summary: {missing}"
