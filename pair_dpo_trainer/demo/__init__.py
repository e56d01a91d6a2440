"""The bundled demo: a tiny Llama snapshot pinned at :data:`DEMO_REVISION` and its preference pairs (no downloads).

This module holds only the paths and the pin the runtime reads; :mod:`.pairs` generates the demo pairs and the
repository tool ``tools/build_demo_assets.py`` regenerates every bundled file deterministically (the tests check the
committed copy against it).
"""

from __future__ import annotations

from pathlib import Path

# sha1(b"pair_dpo_trainer demo snapshot: tiny-llama v1"): the "commit" the bundled snapshot is pinned at.
DEMO_REVISION = "fc705248af39183558528d201ff358185a6d4db6"
DEMO_SEED = 0
MODEL_DIR_NAME = "tiny-llama"
PAIRS_FILE_NAME = "demo_pairs.jsonl"


def bundled_assets_dir() -> Path:
    """Return the directory holding the bundled demo assets.

    Returns:
        Path: ``pair_dpo_trainer/assets``.
    """
    return Path(__file__).resolve().parents[1] / "assets"


def bundled_model_dir() -> Path:
    """Return the bundled tiny Llama snapshot (loadable with ``from_pretrained``).

    Returns:
        Path: ``pair_dpo_trainer/assets/tiny-llama``.
    """
    return bundled_assets_dir() / MODEL_DIR_NAME


def bundled_pairs_path() -> Path:
    """Return the bundled demo preference pairs.

    Returns:
        Path: ``pair_dpo_trainer/assets/demo_pairs.jsonl``.
    """
    return bundled_assets_dir() / PAIRS_FILE_NAME
