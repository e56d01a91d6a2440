"""Choosing and building the reference for a run: the one place where reference modes are selected."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedModel

from pair_dpo_trainer.modeling.attention import enable_pair_varlen
from pair_dpo_trainer.reference.base import FrozenReference, NoReference, Reference, load_reference_model


def build_reference(
    args: Any, policy: PreTrainedModel, *, policy_source: str | None, ref_model: PreTrainedModel | None
) -> Reference:
    """Returns the reference the trainer runs for ``args`` (a ``PairDPOConfig``).

    Modes: ``reference_free`` -> :class:`NoReference`; otherwise a :class:`FrozenReference` of ``ref_model`` when
    given, else loaded from ``args.ref_model_name_or_path`` or the policy's directory, else a copy of the in-memory
    policy.

    Args:
        args: The run's ``PairDPOConfig``.
        policy: The policy before any training step.
        policy_source: Directory the policy was loaded from (None when it was passed in memory).
        ref_model: An explicit reference model, if the user passed one.
    """
    if args.reference_free:
        if ref_model is not None:
            raise ValueError("reference_free=True builds no reference: do not pass ref_model.")
        return NoReference()
    if ref_model is None:
        ref_model = load_reference_model(
            policy, policy_source=policy_source, ref_model_name_or_path=args.ref_model_name_or_path
        )
    enable_pair_varlen(ref_model, args.attn_backend)
    return FrozenReference(ref_model.to(args.device), chunk_size=args.logps_chunk_size)
