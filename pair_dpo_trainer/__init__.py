"""pair_dpo_trainer: pair-atomic, packed, padding-free DPO on Hugging Face Trainer."""

from __future__ import annotations

from typing import Any

from pair_dpo_trainer.errors import (
    ConfigError,
    PairDPOError,
    PreferenceRowError,
    ScheduleError,
    SnapshotIntegrityError,
)
from pair_dpo_trainer.version import __version__

# Heavy entry points are imported on first use, so `pair-dpo verify-snapshot` does not import transformers' Trainer.
_LAZY = {
    "PairDPOConfig": "pair_dpo_trainer.config.arguments",
    "PairDPOTrainer": "pair_dpo_trainer.trainer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pair_dpo_trainer' has no attribute {name!r}")


__all__ = [
    "ConfigError",
    "PairDPOConfig",
    "PairDPOError",
    "PairDPOTrainer",
    "PreferenceRowError",
    "ScheduleError",
    "SnapshotIntegrityError",
    "__version__",
]
