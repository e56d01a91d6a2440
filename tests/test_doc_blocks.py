"""Every Python block of the README, the guide (en + zh) and the TRL migration guide runs as written.

Convention (stated in docs/guide.md section 1): a block whose first line starts with ``# illustrative`` is a sketch and
is not run; every other ```python block must run on the bundled model and demo data. All runnable blocks run in ONE
fresh interpreter (offline), each in its own namespace and its own empty working directory, so the import cost is
paid once; a failing block is reported with its file and line. Blocks whose code is the same up to comments (the
Chinese guide's copies of the English ones) run once.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/guide.md", "docs/guide.zh.md", "docs/migrating_from_trl.md")
ILLUSTRATIVE = "# illustrative"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)

RUNNER = r"""
import json, os, sys, traceback
blocks = json.load(open(sys.argv[1]))
results = []
for i, block in enumerate(blocks):
    os.makedirs(f"block{i}", exist_ok=True)
    os.chdir(f"block{i}")
    try:
        exec(compile(block["code"], f"{block['doc']}:{block['line']}", "exec"), {"__name__": "__main__"})
        results.append(None)
    except BaseException:
        results.append(traceback.format_exc()[-3000:])
    os.chdir("..")
json.dump(results, open(sys.argv[2], "w"))
"""


def doc_blocks(doc: str) -> list[dict]:
    """The ```python blocks of ``doc``: code, 1-based line of the opening fence, runnable or illustrative."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    blocks = []
    for match in BLOCK.finditer(text):
        code = match.group(1)
        line = text.count("\n", 0, match.start()) + 1
        blocks.append({"doc": doc, "line": line, "code": code, "run": not code.lstrip().startswith(ILLUSTRATIVE)})
    return blocks


def test_the_documents_hold_runnable_blocks_and_few_illustrative_ones():
    for doc in DOCS:
        blocks = doc_blocks(doc)
        assert any(block["run"] for block in blocks), doc
        assert sum(not block["run"] for block in blocks) <= 2, doc
    readme = doc_blocks("README.md")
    assert all(block["run"] for block in readme) and "PairDPOTrainer(" in readme[0]["code"]


@pytest.mark.slow
def test_every_runnable_python_block_runs(tmp_path):
    unique = {ast.dump(ast.parse(b["code"])): b for doc in reversed(DOCS) for b in doc_blocks(doc) if b["run"]}
    blocks = list(unique.values())
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    (tmp_path / "runner.py").write_text(RUNNER)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    command = [sys.executable, "runner.py", "blocks.json", "results.json"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    failures = [f"{b['doc']}:{b['line']}\n{error}" for b, error in zip(blocks, results, strict=True) if error]
    assert not failures, "\n\n".join(failures)
    assert len(results) == len(blocks) >= 4
