"""Deprecated name of :mod:`pair_dpo_trainer.fault_tolerance` (same objects), kept for one release.

Import ``PREEMPTED_EXIT_CODE``, ``TrainingPreempted``, ``RunGuard`` and ``GuardOptions`` from
``pair_dpo_trainer.fault_tolerance`` instead; importing this module warns once.
"""

import warnings

from pair_dpo_trainer.fault_tolerance import PREEMPTED_EXIT_CODE, GuardOptions, RunGuard, TrainingPreempted

warnings.warn(
    "pair_dpo_trainer.runtime is deprecated and will be removed in the next release: import from "
    "pair_dpo_trainer.fault_tolerance instead.",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["PREEMPTED_EXIT_CODE", "GuardOptions", "RunGuard", "TrainingPreempted"]
