"""Choosing and building the reference for a run: the one place where reference modes are selected."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedModel

from pair_dpo_trainer.modeling.attention import enable_pair_varlen
from pair_dpo_trainer.reference.base import FrozenReference, NoReference, Reference, load_reference_model
from pair_dpo_trainer.reference.source import ReferenceSource


def build_reference(
    args: Any, policy: PreTrainedModel, *, source: ReferenceSource | None, ref_model: PreTrainedModel | None
) -> Reference:
    """Returns the reference the trainer runs for ``args`` (a ``PairDPOConfig``).

    Modes: ``reference_free`` -> :class:`NoReference`; otherwise a :class:`FrozenReference` of ``ref_model`` when
    given, else loaded from ``source.directory`` (verified when pinned), else a copy of the in-memory policy.

    Args:
        args: The run's ``PairDPOConfig``.
        policy: The policy before any training step.
        source: Where the reference comes from (:func:`~pair_dpo_trainer.reference.source.resolve_reference_source`);
            None for reference-free runs.
        ref_model: An explicit reference model, if the user passed one.
    """
    if args.reference_free:
        if ref_model is not None:
            raise ValueError("reference_free=True builds no reference: do not pass ref_model.")
        return NoReference()
    from pair_dpo_trainer.reference.peft import AdapterDisabledReference, is_peft_model

    if ref_model is None and not args.ref_model_name_or_path and is_peft_model(policy):
        return AdapterDisabledReference(policy, chunk_size=args.logps_chunk_size)  # the base model, no second copy
    if ref_model is None:
        ref_model = load_reference_model(policy, source.directory if source is not None else None)
    enable_pair_varlen(ref_model, args.attn_backend)
    return FrozenReference(ref_model.to(args.device), chunk_size=args.logps_chunk_size)
