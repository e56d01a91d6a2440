"""The frozen reference of standard DPO, or none at all (``reference_free``).

A reference maps a packed micro-batch to per-sequence log-probs ``[2n]`` float32, without gradients. This module
holds the protocol and the in-process references (``FrozenReference`` also serves FSDP2, sharded or replicated:
:mod:`~pair_dpo_trainer.reference.fsdp`); the others are classes with the same ``sequence_logps(batch)``:
:class:`~pair_dpo_trainer.reference.deepspeed.DeepSpeedReference` (an inference-only DeepSpeed engine) and
:class:`~pair_dpo_trainer.reference.precompute.PrecomputedReference` (log-probs carried by the batch).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Protocol

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from pair_dpo_trainer.collators.batch import PackedPairBatch
from pair_dpo_trainer.errors import ConfigError
from pair_dpo_trainer.modeling.logprobs import packed_sequence_logps

NamedParameters = Iterable[tuple[str, "torch.Tensor | Callable[[], torch.Tensor]"]]
"""``(name, tensor)`` pairs of a reference's weights, or ``(name, gather)`` where a sharded value is gathered on call
(:func:`~pair_dpo_trainer.reference.deepspeed.gathered_named_parameters`)."""


class Reference(Protocol):
    """What callers need from a reference (the trainer, :class:`~pair_dpo_trainer.reference.manager.ReferenceManager`,
    the identity gate): nothing is probed with ``getattr``.

    Attributes:
        model: The in-process reference model (what TR-DPO mixes into and ``torch_compile`` compiles), or None when
            there is none of its own: reference-free, adapter-disabled (the policy is the model), precomputed, released.
        probe: Whether the reference identity includes the probe digest (a forward of the probe batch now).
    """

    model: torch.nn.Module | None
    probe: bool

    def sequence_logps(self, batch: PackedPairBatch) -> torch.Tensor:
        """Per-sequence completion log-probs ``[2n]`` float32 (no gradient)."""
        ...

    def identity_parameters(self) -> NamedParameters | None:
        """The parameters the identity's parameter digest covers, or None for a reference without weights."""
        ...

    def release(self) -> None:
        """Drops the reference's weights (after a precompute pass), so their memory can be reused."""
        ...


class NoReference:
    """``reference_free=True``: an implicit uniform reference, log-probs 0 (no model is built)."""

    model: torch.nn.Module | None = None
    probe = True

    def sequence_logps(self, batch: PackedPairBatch) -> torch.Tensor:
        return torch.zeros(batch.num_sequences, dtype=torch.float32, device=batch.input_ids.device)

    def identity_parameters(self) -> NamedParameters | None:
        return None

    def release(self) -> None:
        return None


class FrozenReference:
    """A frozen copy of the policy's starting point: ``eval()``, ``requires_grad_(False)``, never wrapped for
    gradient sync, run under ``torch.no_grad()``.

    Args:
        model: The reference model (already on its device, packed attention configured).
        chunk_size: Tokens per chunk of the log-prob computation.
    """

    probe = True

    def __init__(self, model: torch.nn.Module, chunk_size: int) -> None:
        self.model: torch.nn.Module | None = model.eval().requires_grad_(False)
        self.chunk_size = chunk_size

    @torch.no_grad()
    def sequence_logps(self, batch: PackedPairBatch) -> torch.Tensor:
        return packed_sequence_logps(_built(self.model), batch, chunk_size=self.chunk_size)

    def identity_parameters(self) -> NamedParameters | None:
        """The parameters covered by the reference identity's parameter digest (FSDP2 shards gathered one at a time,
        see :func:`~pair_dpo_trainer.reference.deepspeed.gathered_named_parameters`)."""
        from pair_dpo_trainer.parallel.gather import gathered_named_parameters

        return gathered_named_parameters(_built(self.model))

    def release(self) -> None:
        """Drops the model (after a precompute pass), so its memory can be reused."""
        self.model = None


def _built(model: torch.nn.Module | None) -> torch.nn.Module:
    """``model``, which must not have been released."""
    if model is None:
        raise RuntimeError("the reference model was released after the precompute pass; batches carry ref_logps now")
    return model


def load_reference_model(policy: PreTrainedModel, directory: str | None) -> PreTrainedModel:
    """Loads the reference weights from ``directory`` (verified beforehand when pinned), else copies the policy.

    Args:
        policy: The policy before any training step (its dtype is kept).
        directory: The reference directory chosen by :func:`pair_dpo_trainer.reference.source.resolve_reference_source`;
            None when the reference is a copy of the in-memory policy.

    Returns:
        The reference model on the CPU (the caller moves it).

    Raises:
        ConfigError: ``unsupported_combination`` for a ZeRO-3 partitioned or FSDP2-sharded in-memory policy without
            a directory.
    """
    if directory is None:
        from torch.distributed.tensor import DTensor

        if any(hasattr(p, "ds_id") or isinstance(p, DTensor) for p in policy.parameters()):
            raise ConfigError(
                "unsupported_combination",
                "the policy is already sharded (ZeRO-3 partitioned under deepspeed.zero.Init, or DTensor parameters) "
                "and no reference directory is known, so it cannot be copied: pass the model as a path, or set "
                "ref_model_name_or_path.",
            )
        return copy.deepcopy(policy)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=policy.dtype, trust_remote_code=False)
