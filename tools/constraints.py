"""Writes constraints.txt (what CI installs) or compares it with the newest releases.

``python tools/constraints.py write`` resolves ``torch==2.13.0 -e .[test]`` with pip (``--dry-run --report``, no
install) and pins every resolved distribution. ``python tools/constraints.py diff`` resolves the same without the
constraints and prints each pin the newest releases would raise: the list a deliberate raise starts from.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"
HEADER = """\
# Exact versions CI installs (pip -c constraints.txt). Raised deliberately, never by an upstream release:
# `make deps-latest` installs the newest releases in a throw-away venv, runs the fast tier and lists what would
# change; when it is green, `make constraints` rewrites this file, committed with that test run.
# The package supports more than these pins (pyproject.toml), e.g. transformers 5.17 on the GPU machine.
"""
SKIP = {"pair_dpo_trainer", "setuptools", "pip", "wheel"}


def resolve(python: str = sys.executable) -> dict[str, str]:
    """Distribution name -> version that pip would install for the test extra (newest allowed releases)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [python, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed", "--report", str(report)]
        subprocess.run([*cmd, "torch==2.13.0", "-e", f"{ROOT}[test]"], check=True)
        rows = json.loads(report.read_text())["install"]
    return {
        r["metadata"]["name"].lower(): r["metadata"]["version"].split("+")[0]
        for r in rows
        if r["metadata"]["name"].lower() not in SKIP
    }


def pinned() -> dict[str, str]:
    """Distribution name -> version in constraints.txt."""
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name.lower()] = version
    return pins


def main() -> int:
    action = sys.argv[1] if len(sys.argv) > 1 else "diff"
    if action == "write":
        versions = resolve()
        CONSTRAINTS.write_text(HEADER + "".join(f"{n}=={v}\n" for n, v in sorted(versions.items())))
        print(f"constraints.txt: {len(versions)} pins")
        return 0
    newest, pins = resolve(), pinned()
    changed = {n: (pins.get(n), v) for n, v in newest.items() if pins.get(n) != v}
    for name, (old, new) in sorted(changed.items()):
        print(f"{name}: {old or '(new)'} -> {new}")
    print(f"{len(changed)} of {len(newest)} pins would change" if changed else "constraints.txt is current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
