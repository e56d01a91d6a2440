"""pair_dpo_trainer: pair-atomic, packed, padding-free DPO on Hugging Face Trainer."""

from __future__ import annotations

__version__ = "0.1.0"

from pair_dpo_trainer.errors import (  # noqa: E402
    ConfigError,
    PairDPOError,
    PreferenceRowError,
    ScheduleError,
    SnapshotIntegrityError,
)

__all__ = [
    "ConfigError",
    "PairDPOError",
    "PreferenceRowError",
    "ScheduleError",
    "SnapshotIntegrityError",
    "__version__",
]
