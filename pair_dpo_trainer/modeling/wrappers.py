"""Seeing through wrappers (the HF model inside a DDP / DeepSpeed wrapper, whether a module is an FSDP2 root) and
wrapping one module's ``forward`` for the length of a block.

Details: modeling/README.md, "Module notes", ``wrappers.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
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


@contextlib.contextmanager
def forward_replaced(module: torch.nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """``module``'s calls run ``forward`` inside the block (an instance attribute shadows the class method, so the
    module's hooks still fire around it), then whatever ``forward`` the module had before.

    Example:
        >>> layer = torch.nn.Linear(2, 2)
        >>> with forward_replaced(layer, lambda x: x + 1):
        ...     layer(torch.zeros(2)).tolist()
        [1.0, 1.0]
        >>> "forward" in layer.__dict__
        False
    """
    own = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own
