"""The run's options: ``PairDPOConfig``, TRL's names for them, and what the launcher decides.

A leaf of the package: it imports nothing of it but :mod:`pair_dpo_trainer.errors`. Each option's own range checks
live here; the checks that need a feature's knowledge (objectives, attention kernels, sharding) live with the feature
and are collected by :mod:`pair_dpo_trainer.training.checks`.
"""

from pair_dpo_trainer.config.arguments import DEFAULT_MAX_PROMPT_LENGTH, PairDPOConfig, default_max_prompt_length

__all__ = ["DEFAULT_MAX_PROMPT_LENGTH", "PairDPOConfig", "default_max_prompt_length"]
