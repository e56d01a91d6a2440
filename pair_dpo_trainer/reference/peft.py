"""The reference of a PEFT (LoRA, ...) policy: the policy itself with its adapters disabled.

A ``peft.PeftModel`` policy is a frozen base model plus small trainable adapters. The DPO reference is the policy's
starting point, which is the base model, so no second copy of the weights is built: the reference pass runs the
policy's own modules inside ``policy.disable_adapter()``, under ``torch.no_grad()`` and in eval mode (no dropout),
then restores the exact train/eval flag of every module. The pass calls the unwrapped policy directly, never the
DDP / DeepSpeed wrapper, so no gradient-sync bookkeeping sees it (the same approach as TRL's ``null_ref_context``).

``peft`` is optional (``pip install "pair_dpo_trainer[peft]"``): :func:`is_peft_model` returns False when it is not
installed, and nothing here imports it at module import time.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import torch

from pair_dpo_trainer.collators.batch import PackedPairBatch
from pair_dpo_trainer.modeling.chunked_head import DEFAULT_CHUNK_SIZE
from pair_dpo_trainer.modeling.logprobs import packed_sequence_logps
from pair_dpo_trainer.modeling.wrappers import unwrap_model


def is_peft_model(model: Any) -> bool:
    """True when ``model`` (or the model inside a DDP / DeepSpeed wrapper) is a ``peft.PeftModel``.

    Does not import ``peft`` when nothing imported it yet: a model cannot be a ``PeftModel`` then.

    Args:
        model: Any object, typically the policy passed to the trainer.

    Example:
        >>> is_peft_model(torch.nn.Linear(2, 2))
        False
    """
    peft = sys.modules.get("peft")
    if peft is None or not isinstance(model, torch.nn.Module):
        return False
    return isinstance(unwrap_model(model), peft.PeftModel)


class AdapterDisabledReference:
    """Reference log-probs of a PEFT policy with its adapters disabled: the base model, without a copy.

    Args:
        policy: The ``peft.PeftModel`` policy (a DDP / DeepSpeed wrapper around it is unwrapped and not kept).
        chunk_size: Tokens per chunk of the log-prob computation (``PairDPOConfig.logps_chunk_size``).
        probe: Whether the reference identity includes the probe digest (a forward of the probe batch). False under
            FSDP2: the identity is computed before Accelerate shards the policy, when it is not on the accelerator
            yet; manifest and parameter digests still identify the reference.

    Raises:
        TypeError: ``policy`` is not a ``peft.PeftModel``.
    """

    def __init__(self, policy: torch.nn.Module, chunk_size: int = DEFAULT_CHUNK_SIZE, probe: bool = True) -> None:
        if not is_peft_model(policy):
            raise TypeError(f"AdapterDisabledReference needs a peft.PeftModel policy, got {type(policy).__name__}.")
        self.policy = unwrap_model(policy)
        self.model: torch.nn.Module | None = None  # no model of its own: the policy is the model
        self.chunk_size = chunk_size
        self.probe = probe

    def release(self) -> None:
        """Nothing to free: the weights are the policy's."""
        return None

    def identity_parameters(self) -> Iterator[tuple[str, Any]]:
        """The base-model parameters the reference identity's parameter digest covers (adapter weights excluded;
        FSDP2 shards gathered one at a time, see ``reference.deepspeed.gathered_named_parameters``)."""
        from pair_dpo_trainer.parallel.gather import gathered_named_parameters

        prefix = getattr(self.policy.base_model, "prefix", None)  # the tuner's parameter prefix, e.g. "lora_"
        for name, param in gathered_named_parameters(self.policy):
            parts = name.split(".")
            if "modules_to_save" in parts or (prefix and any(part.startswith(prefix) for part in parts)):
                continue
            yield name, param

    def sequence_logps(self, batch: PackedPairBatch) -> torch.Tensor:
        """Per-sequence completion log-probs ``[2n]`` float32 of the base model (no gradient).

        The policy is switched to eval mode for the pass (no dropout, no gradient checkpointing) and every module
        gets its previous ``training`` flag back afterwards, also when the forward raises.
        """
        modes = [(module, module.training) for module in self.policy.modules()]
        self.policy.eval()
        try:
            with torch.no_grad(), self.policy.disable_adapter():
                return packed_sequence_logps(self.policy, batch, chunk_size=self.chunk_size)
        finally:
            for module, training in modes:
                module.training = training
