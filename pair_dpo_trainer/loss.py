"""Compatibility path: the objectives now live in :mod:`pair_dpo_trainer.losses` (one module per family)."""

from pair_dpo_trainer.losses import *  # noqa: F403
from pair_dpo_trainer.losses import __all__  # noqa: F401
