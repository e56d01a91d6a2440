"""Seeing through wrappers: the HF model inside a DDP / DeepSpeed wrapper, and whether a module is an FSDP2 root."""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel


def unwrap_model(model: torch.nn.Module) -> Any:
    """Strip wrappers that hold the model as ``.module`` (DDP, DeepSpeed engine) down to the HF model.

    Returns ``Any``: the model is used by the transformers API it offers (``config``, ``get_decoder()``,
    ``get_output_embeddings()``), which a ``PreTrainedModel`` or a PEFT model provides, duck-typed."""
    current: Any = model
    while not isinstance(current, PreTrainedModel) and isinstance(getattr(current, "module", None), torch.nn.Module):
        current = current.module
    return current


def is_fsdp_managed(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or the model inside a wrapper) is an FSDP2 ``fully_shard`` root.

    Accelerate always shards the root, and so does the FSDP2 reference; the check does not
    depend on whether the parameters are sharded or gathered at this moment (``reshard_after_forward=False``
    units stay gathered between forwards).
    """
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule) or isinstance(unwrap_model(model), FSDPModule)
