"""Importing the package prints nothing, and its optional backends (DeepSpeed, torchao) are imported only by the code
that uses them: checked in fresh interpreters, with both backends installed (the test extra).

Third-party imports outside the package's reach are named, not filtered: transformers imports torchao whenever it is
installed (``transformers.quantizers.quantizer_torchao``, reached from ``TrainingArguments`` through ``peft`` and from
``Trainer``), and accelerate imports DeepSpeed whenever it is installed (``extract_model_from_parallel``, which
``Trainer.__init__`` calls); docs/guide.md, "Troubleshooting", says what they print and how to remove them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("deepspeed", "torchao")

# Records, for the first real import of each backend, the file and line of the code that imported it (an
# availability check, importlib.util.find_spec, is not an import and is skipped).
RECORDER = """
import importlib, json, pkgutil, sys, traceback
importers = {}
class Recorder:
    def find_spec(self, name, path=None, target=None):
        frames = traceback.extract_stack()[:-1]
        if name in %(backends)r and name not in importers and frames[-2].name == "_find_and_load_unlocked":
            outside = [f for f in frames if not f.filename.startswith("<frozen") and "importlib" not in f.filename]
            importers[name] = "%%s:%%d" %% (outside[-1].filename, outside[-1].lineno)
        return None
sys.meta_path.insert(0, Recorder())
"""


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


def test_importing_the_package_and_train_py_prints_nothing_and_loads_no_backend():
    done = _python(
        "import sys\nimport pair_dpo_trainer, pair_dpo_trainer.errors, pair_dpo_trainer.cli, train\n"
        "loaded = [m for m in ('deepspeed', 'torchao', 'peft', 'transformers') if m in sys.modules]\n"
        "sys.exit(f'loaded {loaded}' if loaded else 0)\n"
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


@pytest.mark.slow  # imports every module of the package (torch, transformers, accelerate, datasets) in a fresh process
def test_no_module_of_the_package_imports_deepspeed_or_torchao_when_imported():
    done = _python(
        RECORDER % {"backends": BACKENDS} + "import pair_dpo_trainer\n"
        "for module in pkgutil.walk_packages(pair_dpo_trainer.__path__, 'pair_dpo_trainer.'):\n"
        "    importlib.import_module(module.name)\n"
        "print(json.dumps({'importers': importers, 'deepspeed': 'deepspeed' in sys.modules}))\n"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    ours = {name: where for name, where in found["importers"].items() if where.startswith(str(ROOT))}
    assert not ours, f"the package imports an optional backend when imported: {ours}"
    assert found["deepspeed"] is False  # no module of the package, nor what it imports, loads DeepSpeed
    assert "Setting accelerator" not in done.stdout + done.stderr
    # torchao, if installed, is imported by transformers itself (named in the module docstring), never by the package
    assert all("/transformers/" in where for where in found["importers"].values()), found
