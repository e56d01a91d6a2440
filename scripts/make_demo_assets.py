#!/usr/bin/env python
"""Regenerate the bundled demo assets (tiny Llama snapshot + demo pairs), offline and deterministically.

Usage::

    python scripts/make_demo_assets.py                      # rewrite pair_dpo_trainer/assets/
    python scripts/make_demo_assets.py --output-dir /tmp/a  # write elsewhere
    python scripts/make_demo_assets.py --check              # compare the committed tree, write nothing

The same seed gives byte-identical files. Note: ``tiny-llama/.cache/huggingface/.gitignore`` holds ``*`` (as
``hf download --local-dir`` writes it), so the metadata files must be staged with ``git add -f``.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections.abc import Sequence
from pathlib import Path

from pair_dpo_trainer import demo


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line.

    Args:
        argv: Arguments without the program name; ``None`` reads ``sys.argv``.

    Returns:
        argparse.Namespace: ``seed``, ``num_pairs``, ``output_dir`` and ``check``.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=demo.DEMO_SEED, help="seed for pairs and weights")
    parser.add_argument("--num-pairs", type=int, default=demo.DEMO_NUM_PAIRS, help="number of preference pairs")
    parser.add_argument(
        "--output-dir", type=Path, default=demo.bundled_assets_dir(), help="assets directory to (re)write"
    )
    parser.add_argument("--check", action="store_true", help="only compare output-dir with a fresh build")
    return parser.parse_args(argv)


def check_tree(output_dir: Path, files: dict[str, bytes]) -> list[str]:
    """List the differences between ``output_dir`` and the freshly built ``files``.

    Args:
        output_dir: Existing assets directory.
        files: Path relative to ``output_dir`` -> expected content.

    Returns:
        list[str]: One line per missing, extra or differing file; empty when identical.
    """
    on_disk = {
        p.relative_to(output_dir).as_posix()
        for p in output_dir.rglob("*")
        if p.is_file() and not p.name.endswith(".lock")
    }
    problems = [f"extra: {rel}" for rel in sorted(on_disk - set(files))]
    for rel, data in files.items():
        if rel not in on_disk:
            problems.append(f"missing: {rel}")
        elif (output_dir / rel).read_bytes() != data:
            problems.append(f"differs: {rel}")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    """Build the assets, then write them (or compare them with ``--check``).

    Args:
        argv: Arguments without the program name.

    Returns:
        int: Exit status (0 on success, 1 when ``--check`` finds differences).
    """
    args = parse_args(argv)
    files = demo.demo_asset_files(args.seed, args.num_pairs)
    if args.check:
        problems = check_tree(args.output_dir, files)
        print("\n".join(problems) or f"OK: {len(files)} files match")
        return 1 if problems else 0
    demo.write_demo_assets(args.output_dir, args.seed, args.num_pairs)
    for rel, data in files.items():
        print(f"{hashlib.sha256(data).hexdigest()}  {len(data):>9}  {rel}")
    print(f"total {sum(len(d) for d in files.values())} bytes in {len(files)} files -> {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
