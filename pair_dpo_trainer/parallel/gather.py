"""Full copies of sharded parameters, one parameter at a time: ZeRO-3 partitions and FSDP2 ``DTensor`` shards.

Every function here is a collective for a sharded parameter: every rank must call it for the same parameters in the
same order (sorted names, as the identity digest does).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def _gathered_copy(param: torch.nn.Parameter) -> torch.Tensor:
    """The full value of one ZeRO-3 parameter as a CPU tensor (collective: every rank must call it)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
        return param.detach().to("cpu", copy=True)


def _full_copy(param: DTensor) -> torch.Tensor:
    """The full value of one FSDP2 (DTensor) parameter as a CPU tensor (collective: every rank must call it)."""
    if param.device.type != param.device_mesh.device_type:  # CPU-offloaded shards: all-gather on the mesh's device
        param = cast("DTensor", param.to(param.device_mesh.device_type))
    return param.full_tensor().detach().to("cpu", copy=True)


CHECKPOINT_WRAPPER_PREFIX = "._checkpoint_wrapped_module"
"""Inserted into parameter names by activation checkpointing wrappers (FSDP's ``activation_checkpointing``)."""


def gathered_named_parameters(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor | Callable[[], Any]]]:
    """``named_parameters`` for :func:`~pair_dpo_trainer.integrity.identity.parameter_digest`, ZeRO-3 / FSDP2 aware.

    A partitioned ZeRO-3 parameter (it has ``ds_id``) or a sharded FSDP2 parameter (a ``DTensor``) is yielded as a
    loader that gathers just that parameter and returns a CPU copy; ``parameter_digest`` calls the loaders one at a
    time in sorted-name order, which is the same on every rank. Other parameters are yielded as they are. Names
    lose the activation-checkpointing wrapper's ``._checkpoint_wrapped_module`` (the digest of a model does not
    depend on how it is wrapped).
    """
    from torch.distributed.tensor import DTensor

    for name, param in module.named_parameters():
        name = name.replace(CHECKPOINT_WRAPPER_PREFIX, "")
        if hasattr(param, "ds_id"):
            yield name, functools.partial(_gathered_copy, param)
        elif isinstance(param, DTensor):
            yield name, functools.partial(_full_copy, param)
        else:
            yield name, param
