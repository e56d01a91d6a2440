"""The reference under FSDP2: sharded with ``fully_shard`` as an inference-only module, or replicated.

Under an FSDP2 policy (``parallel.fsdp2``) the frozen reference is never given to Accelerate (it has no optimizer;
``accelerator.prepare`` takes one model). It is built here, in one of two layouts (``PairDPOConfig.ref_fsdp_shard``):

Details: reference/README.md, "Module notes", ``fsdp.py``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from pair_dpo_trainer.config.sections import LayerOptions, ReferenceOptions
from pair_dpo_trainer.errors import ConfigError
from pair_dpo_trainer.modeling.compile import compile_decoder_layers
from pair_dpo_trainer.modeling.float8 import convert_to_fp8
from pair_dpo_trainer.modeling.layers import find_decoder_layers
from pair_dpo_trainer.parallel.fsdp2 import compute_dtype, offloads_params
from pair_dpo_trainer.reference.base import FrozenReference

logger = logging.getLogger(__name__)


def fsdp_reference_problems(reference: ReferenceOptions, *, fsdp: bool, peft_reference: bool) -> list[tuple[str, str]]:
    """``(reason_code, message)`` for reference options that do not fit the run's FSDP setting.

    Args:
        reference: The run's reference section.
        fsdp: Whether the policy runs under FSDP2.
        peft_reference: Whether the reference is the PEFT policy with its adapters disabled.
    """
    if (
        not reference.uses_reference and reference.ref_fsdp_shard is not None
    ):  # reference_free or reference-free objectives
        return [("unsupported_combination", "this run builds no reference (reference-free): remove ref_fsdp_shard.")]
    if not fsdp:
        shard = reference.ref_fsdp_shard
        if shard is None:
            return []
        return [
            (
                "unsupported_combination",
                f"ref_fsdp_shard={shard} sets the layout of an FSDP2 reference, but this run does not "
                "use FSDP2: launch with an FSDP2 config (accelerate_configs/fsdp2.yaml) or leave ref_fsdp_shard unset.",
            )
        ]
    if peft_reference and reference.precompute_ref_log_probs:
        return [
            (
                "unsupported_combination",
                "precompute_ref_log_probs=True with a PEFT policy under FSDP2: its reference is the policy itself, "
                "which Accelerate shards only when train() starts, so a reference pass before training would run the "
                "whole unsharded policy on one device. Leave precompute_ref_log_probs off (the adapter-disabled "
                "reference is one no-grad forward of the sharded policy), or set ref_model_name_or_path for a separate "
                "reference.",
            )
        ]
    return []


def build_fsdp_reference(
    model: torch.nn.Module,
    *,
    plugin: Any,
    reference: ReferenceOptions,
    layers: LayerOptions,
    device: torch.device | str,
) -> FrozenReference:
    """The reference of an FSDP2 run, sharded or replicated (see the module docstring).

    Args:
        model: The loaded reference (whole, on the CPU, packed attention configured), or a module already sharded
            with ``fully_shard`` (used as it is).
        plugin: The run's FSDP2 plugin (compute dtype, offloading).
        reference: The run's reference section (``ref_fsdp_shard``, ``ref_offload_params``).
        layers: The run's layer section (``fp8``, ``torch_compile*``, ``logps_chunk_size``).
        device: The device of this rank.

    Raises:
        ConfigError: ``unsupported_combination`` for ``ref_fsdp_shard=False`` with an already sharded model, or a
            reference without recognisable decoder layers to shard.
    """
    from torch.distributed.fsdp import FSDPModule

    shard = reference.ref_fsdp_shard is not False
    if isinstance(model, FSDPModule):
        if not shard:
            raise ConfigError(
                "unsupported_combination",
                "the ref_model object is already sharded with fully_shard, but ref_fsdp_shard=False replicates the "
                "reference: pass an unsharded model (or ref_model_name_or_path), or leave ref_fsdp_shard unset.",
            )
        return FrozenReference(model, chunk_size=layers.logps_chunk_size)
    dtype = compute_dtype(plugin)
    model = model.eval().requires_grad_(False)
    if dtype is not None:
        cast_parameters(model, dtype)
    if layers.fp8 is not None:  # the policy's recipe, before sharding (training.layers converts the policy)
        convert_to_fp8(model, layers.fp8, fsdp_float8_all_gather=shard and layers.fp8 == "tensorwise")
    if layers.torch_compile:
        compile_decoder_layers(model, backend=layers.compile_backend, mode=layers.torch_compile_mode)
    if shard:
        offload = reference.ref_offload_params
        offload = offloads_params(plugin) if offload is None else offload
        shard_reference(model, offload=offload)
    else:
        model = model.to(device)
    logger.info("FSDP2 reference: %s, %s", "sharded" if shard else "replicated", dtype or "parameter dtype")
    return FrozenReference(model, chunk_size=layers.logps_chunk_size)


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Casts the parameters (not the buffers) to ``dtype`` in place, as FSDP2's ``MixedPrecisionPolicy`` does for the
    policy: a buffer such as the rotary ``inv_freq`` stays float32 (``model.to(bf16)`` would round it, and the
    reference would no longer compute what the policy computes at step 0). Tied parameters stay tied."""
    for param in model.parameters():
        param.data = param.data.to(dtype)


def shard_reference(model: torch.nn.Module, *, offload: bool = False) -> None:
    """``fully_shard`` on every decoder layer, the untied input embedding and the root, for inference (in place).

    Args:
        model: A frozen causal LM (``requires_grad=False``) in its compute dtype.
        offload: Keep the shards in CPU memory (``CPUOffloadPolicy``).

    Raises:
        ConfigError: ``unsupported_combination`` when the model has no recognisable decoder layers.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    layers = find_decoder_layers(model)
    if layers is None:
        raise ConfigError(
            "unsupported_combination",
            f"the FSDP2 reference is sharded per decoder layer, but {type(model).__name__} has none that "
            "pair_dpo_trainer recognises: set ref_fsdp_shard=False to replicate it.",
        )
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    for layer in layers:
        fully_shard(layer, reshard_after_forward=True, offload_policy=policy)
    target: Any = model  # a transformers causal LM
    embedding, head = target.get_input_embeddings(), target.get_output_embeddings()
    if embedding is not None and (head is None or embedding.weight is not head.weight):
        fully_shard(embedding, reshard_after_forward=True, offload_policy=policy)
    fully_shard(model, reshard_after_forward=True, offload_policy=policy)
