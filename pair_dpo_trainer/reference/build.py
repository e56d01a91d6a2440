"""Choosing and building the reference for a run: the one place where reference modes are selected."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from transformers import PreTrainedModel

from pair_dpo_trainer.config.sections import LayerOptions, ReferenceOptions
from pair_dpo_trainer.modeling.attention import enable_pair_varlen
from pair_dpo_trainer.parallel.sequence import apply_sequence_parallel
from pair_dpo_trainer.reference.base import FrozenReference, NoReference, Reference, load_reference_model
from pair_dpo_trainer.reference.source import ReferenceSource


def build_reference(
    reference: ReferenceOptions,
    layers: LayerOptions,
    policy: PreTrainedModel,
    *,
    source: ReferenceSource | None,
    ref_model: PreTrainedModel | None,
    device: torch.device | str,
    deepspeed_config: Mapping[str, Any] | None = None,
    fsdp_plugin: Any = None,
) -> Reference:
    """Returns the reference the trainer runs for the run's reference and layer sections.

    Modes: ``reference_free`` or only reference-free objectives -> :class:`NoReference`; otherwise the reference
    model is ``ref_model`` when given,
    else loaded from ``source.directory`` (verified when pinned), else a copy of the in-memory policy; it runs as a
    :class:`~pair_dpo_trainer.reference.deepspeed.DeepSpeedReference` (its own inference-only engine) when DeepSpeed is
    enabled, as an FSDP2-sharded or replicated :class:`FrozenReference` under FSDP2
    (:mod:`~pair_dpo_trainer.reference.fsdp`), else as a :class:`FrozenReference` on ``device``.

    Args:
        reference: The run's reference section (``uses_reference``, the reference model and engine options).
        layers: The run's layer section (attention kernel, float8 / compile under FSDP2, the log-prob chunk).
        policy: The policy before any training step.
        source: Where the reference comes from (:func:`~pair_dpo_trainer.reference.source.resolve_reference_source`);
            None for reference-free runs.
        ref_model: An explicit reference model, if the user passed one.
        device: This rank's device.
        deepspeed_config: The run's DeepSpeed configuration when DeepSpeed is enabled.
        fsdp_plugin: The run's FSDP2 plugin when FSDP2 is enabled (``parallel.fsdp2.setup_fsdp2``).
    """
    if not reference.uses_reference:  # reference_free=True, or only reference-free objectives (simpo, orpo, sft)
        return NoReference()  # a ref_model passed anyway is refused by run_checks.reference_problems
    from pair_dpo_trainer.reference.peft import AdapterDisabledReference, is_peft_model

    if ref_model is None and not reference.ref_model_name_or_path and is_peft_model(policy):
        # sync_ref_model and the reference engine options are refused for it by run_checks.reference_problems
        probe = fsdp_plugin is None  # under FSDP2 the policy is not on the accelerator before train() shards it
        return AdapterDisabledReference(policy, chunk_size=layers.logps_chunk_size, probe=probe)  # no second copy
    if deepspeed_config is not None:
        return _deepspeed_reference(
            reference, layers, policy, source=source, ref_model=ref_model, deepspeed_config=deepspeed_config
        )
    if ref_model is None:
        ref_model = load_reference_model(policy, source.directory if source is not None else None)
    enable_pair_varlen(ref_model, layers.attn_backend)
    apply_sequence_parallel(ref_model, layers.sequence_parallel_size)
    if fsdp_plugin is not None:
        from pair_dpo_trainer.reference.fsdp import build_fsdp_reference

        return build_fsdp_reference(ref_model, plugin=fsdp_plugin, reference=reference, layers=layers, device=device)
    return FrozenReference(cast(Any, ref_model).to(device), chunk_size=layers.logps_chunk_size)


def _deepspeed_reference(
    reference: ReferenceOptions,
    layers: LayerOptions,
    policy: PreTrainedModel,
    *,
    source: ReferenceSource | None,
    ref_model: PreTrainedModel | None,
    deepspeed_config: Mapping[str, Any],
) -> Reference:
    """The reference as its own inference-only DeepSpeed engine, loaded under its own ``zero.Init`` configuration
    (sharded, ZeRO stage 3) or whole (replicated, stage 0: ``ref_zero_stage=0`` or a policy that is not ZeRO-3).

    The hidden-size dependent tuning values come from the reference's config (the policy's for a reference loaded
    from a directory, which shares the policy's architecture).
    """
    from pair_dpo_trainer.reference.deepspeed import (
        build_deepspeed_reference,
        hidden_size_of,
        reference_ds_config,
        reference_zero_init,
    )

    config = reference_ds_config(
        deepspeed_config,
        hidden_size=hidden_size_of((ref_model if ref_model is not None else policy).config),
        offload_params=reference.ref_offload_params,
        zero_stage=reference.ref_zero_stage,
    )
    if ref_model is None:
        with reference_zero_init(config):
            ref_model = load_reference_model(policy, source.directory if source is not None else None)
    enable_pair_varlen(ref_model, layers.attn_backend)
    apply_sequence_parallel(ref_model, layers.sequence_parallel_size)
    return build_deepspeed_reference(
        ref_model, config=config, chunk_size=layers.logps_chunk_size, leaf_modules=layers.zero3_leaf_modules
    )
