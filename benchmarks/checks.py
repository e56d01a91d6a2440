"""Small checks the suites run on the GPU machine. ``python -m benchmarks.checks defaults``: the DPO defaults
``PairDPOConfig`` resolves there (``bf16``, ``mixed_precision``, learning rate, logging steps; ``bf16=False`` expected
under ``ACCELERATE_MIXED_PRECISION=fp16``)."""

from __future__ import annotations

import argparse
import os
import tempfile


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("check", choices=("defaults",))
    return p.parse_args(argv)


def defaults() -> str:
    """One line: the defaults a plain ``PairDPOConfig(output_dir=...)`` resolves on this machine."""
    from pair_dpo_trainer import PairDPOConfig

    c = PairDPOConfig(output_dir=os.path.join(tempfile.gettempdir(), "pair_dpo_defaults"))
    env = os.environ.get("ACCELERATE_MIXED_PRECISION")
    line = f"bf16={c.bf16} mixed_precision={c.mixed_precision} lr={c.learning_rate} logging_steps={c.logging_steps}"
    return line + (f" under ACCELERATE_MIXED_PRECISION={env}" if env else "")


def main(argv: list[str] | None = None) -> None:
    parse_args(argv)
    print(defaults(), flush=True)


if __name__ == "__main__":
    main()
