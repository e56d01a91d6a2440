"""The run's options: ``PairDPOConfig``, TRL's names for them, and what the launcher decides.

A leaf of the package: it imports nothing of it but :mod:`pair_dpo_trainer.errors`. Each option's own range checks
live here; the checks that need a feature's knowledge (objectives, attention kernels, sharding) live with the feature
and are collected by :mod:`pair_dpo_trainer.training.checks`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pair_dpo_trainer.config.arguments import DEFAULT_MAX_PROMPT_LENGTH, PairDPOConfig, default_max_prompt_length

_FROM_ARGUMENTS = ("DEFAULT_MAX_PROMPT_LENGTH", "PairDPOConfig", "default_max_prompt_length")


def __getattr__(name: str) -> Any:
    """The config's names, imported on first use: ``arguments`` imports transformers' ``TrainingArguments``, which
    ``config.allocator`` / ``config.trl_names`` (read by ``train.py --help`` and the CLI) do not need."""
    if name in _FROM_ARGUMENTS:
        from pair_dpo_trainer.config import arguments

        return getattr(arguments, name)
    raise AttributeError(f"module 'pair_dpo_trainer.config' has no attribute {name!r}")


__all__ = ["DEFAULT_MAX_PROMPT_LENGTH", "PairDPOConfig", "default_max_prompt_length"]
