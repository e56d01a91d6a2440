"""A policy wrapped in PEFT adapters from ``peft_config=``, as TRL 1.16's ``DPOTrainer`` wraps it.

``peft.get_peft_model(model, peft_config)`` (with ``autocast_adapter_dtype=False`` under DeepSpeed ZeRO-3, whose
partitioned parameters must keep one dtype); with gradient checkpointing the input embeddings' outputs require
gradients (``enable_input_require_grads``), so the checkpointed blocks of a frozen base model still pass gradients to
the adapters. The reference of such a policy is the policy with its adapters disabled (``reference/peft.py``).
``peft`` is imported only when a ``peft_config`` is given.

Details: modeling/README.md, "Module notes", ``peft.py``.
"""

from __future__ import annotations

from typing import Any

from pair_dpo_trainer.errors import ConfigError


def wrap_with_peft(
    model: Any, peft_config: Any, *, gradient_checkpointing: bool, zero3: bool, seed: int | None = None
) -> Any:
    """Returns ``model`` wrapped in the adapters of ``peft_config`` (a ``peft.PeftConfig``).

    Args:
        model: The policy, a ``PreTrainedModel`` (not already a ``peft.PeftModel``).
        peft_config: The adapter configuration (e.g. ``peft.LoraConfig(...)``).
        gradient_checkpointing: The run's ``gradient_checkpointing``.
        zero3: The policy runs under DeepSpeed ZeRO-3.
        seed: Seeds the adapters' random initialisation first (``args.seed``, as TRL seeds before wrapping), so a
            run's adapters start the same as TRL's; None leaves the random state as it is.

    Raises:
        ConfigError: ``peft_not_installed`` without ``peft``; ``unsupported_combination`` for a model that already
            is a ``peft.PeftModel`` (TRL refuses it too: merge or pass it without ``peft_config``).
    """
    try:
        import peft
    except ImportError as exc:
        raise ConfigError(
            "peft_not_installed",
            "peft_config= needs the peft package: pip install 'pair_dpo_trainer[peft]' (or pip install peft).",
        ) from exc
    if isinstance(model, peft.PeftModel):
        raise ConfigError(
            "unsupported_combination",
            "peft_config= was given with a model that already is a peft.PeftModel: pass the PeftModel without "
            "peft_config (its adapters train), or merge its adapters first (model.merge_and_unload()).",
        )
    if seed is not None:
        from transformers import set_seed

        set_seed(seed)
    wrapped = peft.get_peft_model(model, peft_config, autocast_adapter_dtype=not zero3)
    if gradient_checkpointing:
        wrapped.enable_input_require_grads()
    return wrapped
