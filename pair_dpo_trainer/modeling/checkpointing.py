"""Activation checkpointing of a causal LM's decoder layers: every layer, every K-th layer, or selective (matmul and
attention outputs kept, element-wise ops recomputed), and offloading saved activations to host memory.

The checkpoint wraps the layer's own ``forward`` (one class-level wrapper reading per-instance flags), so it sits
inside the regionally compiled layer (``modeling.compile``: compile after this), parameter names do not change, and
FSDP2's module hooks stay outside it. It applies only in training with gradients enabled: reference forwards and
evaluation run the layer as it is.

Details: modeling/README.md, "Module notes", ``checkpointing.py``.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from pair_dpo_trainer.config.option_checks import parse_activation_checkpointing
from pair_dpo_trainer.errors import ConfigError
from pair_dpo_trainer.modeling.layers import find_decoder_layers
from pair_dpo_trainer.modeling.wrappers import unwrap_model

_FLAG = "_pair_dpo_checkpoint"
_CONTEXT = "_pair_dpo_checkpoint_context"
_WRAPPED = "_pair_dpo_checkpoint_wrapped"


def _aten_op(name: str) -> Any:
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet, None), overload, None)


_SAVED_OPS = tuple(
    op
    for op in map(
        _aten_op,
        (
            "mm.default",
            "addmm.default",
            "bmm.default",
            "_scaled_mm.default",
            "_scaled_dot_product_flash_attention.default",
            "_scaled_dot_product_efficient_attention.default",
            "_scaled_dot_product_cudnn_attention.default",
            "_flash_attention_forward.default",
            "_efficient_attention_forward.default",
        ),
    )
    if op is not None
)
"""Ops whose outputs selective checkpointing keeps: the matmuls and the attention kernels (the expensive work)."""


def _selective_policy(_ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
    """Save the outputs of matmuls and attention (torch's varlen and flash-attn's kernels too), recompute the rest."""
    if op in _SAVED_OPS or "varlen_attn" in str(op) or "flash_attn" in str(op):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed_forward(inner: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(inner)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, _FLAG, False) and self.training and torch.is_grad_enabled():
            context = getattr(self, _CONTEXT, None)
            if context is None:  # no context_fn at all: a no-op one is not traceable by dynamo
                return checkpoint(inner, self, *args, use_reentrant=False, **kwargs)
            return checkpoint(inner, self, *args, use_reentrant=False, context_fn=context, **kwargs)
        return inner(self, *args, **kwargs)

    return forward


def _kernel_routing_is_idle(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward is the ``kernels`` hub routing wrapper (transformers >= 5.25 decorates attention
    with ``use_kernelized_func``) and routes every function to the function itself (the model was never
    ``kernelize``d)."""
    wrapped = getattr(type(module).forward, "__wrapped__", None)
    private = module.__dict__.get("_kernel_funcs")
    if wrapped is None or not isinstance(private, dict) or "forward" in module.__dict__:
        return False
    return all(type(func).forward is getattr(func.forward, "__func__", None) for func in private.values())


def _drop_idle_kernel_routing(layer: torch.nn.Module) -> None:
    """Binds the undecorated forward on the modules of ``layer`` whose ``kernels`` routing is idle.

    The routing wrapper stores the active functions in a global (``CompileableContextVar``) on every call; inside a
    checkpoint that is compiled, dynamo refuses such a mutation ("HOP: Unsafe side effect"), so checkpointing and
    ``torch_compile`` together would fail. When the model was never ``kernelize``d the routing selects the plain
    function, so calling the undecorated forward computes exactly the same thing. A ``kernelize``d module keeps its
    routing.
    """
    for module in layer.modules():
        if _kernel_routing_is_idle(module):
            plain = getattr(type(module).forward, "__wrapped__")  # noqa: B009 (functools.wraps sets it; mypy can't see it)
            module.forward = types.MethodType(plain, module)


def apply_activation_checkpointing(model: torch.nn.Module, mode: str) -> int:
    """Marks the decoder layers of ``model`` that ``mode`` checkpoints; returns how many are checkpointed.

    Call before the layers are compiled. Calling it again with another mode re-marks the layers (the auto mode's
    memory probe does).

    Args:
        model: A transformers causal LM (or a wrapper around one).
        mode: ``"off"``, ``"full"``, ``"selective"`` or ``"layers:K"`` (``PairDPOConfig.activation_checkpointing_mode``,
            ``"auto"`` resolved to one of these).

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> m = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=4,
        ...     num_attention_heads=2, vocab_size=64))
        >>> apply_activation_checkpointing(m, "layers:2"), apply_activation_checkpointing(m, "off")
        (2, 0)

    Raises:
        ConfigError: ``bad_activation_checkpointing`` for an unknown mode or ``auto``; ``compile_unsupported`` for
            a model without recognisable decoder layers.
    """
    parsed = parse_activation_checkpointing(mode)
    if parsed is None or parsed[0] == "auto":
        raise ConfigError("bad_activation_checkpointing", f"activation_checkpointing_mode={mode!r} cannot be applied.")
    kind, every = parsed
    layers = find_decoder_layers(model)
    if layers is None:
        raise ConfigError(
            "compile_unsupported",
            f"activation_checkpointing_mode={mode!r} checkpoints the repeated decoder layers, but "
            f"{type(unwrap_model(model)).__name__} has none that pair_dpo_trainer recognises: set it to 'off'.",
        )
    context = (
        functools.partial(create_selective_checkpoint_contexts, _selective_policy) if kind == "selective" else None
    )
    marked = 0
    for index, layer in enumerate(layers):
        cls = type(layer)
        if not cls.__dict__.get(_WRAPPED, False):
            cls.forward = _checkpointed_forward(cls.forward)
            setattr(cls, _WRAPPED, True)
        on = kind != "off" and index % every == 0
        if on:
            _drop_idle_kernel_routing(layer)
        setattr(layer, _FLAG, on)
        setattr(layer, _CONTEXT, context)
        marked += on
    return marked


def offload_activations(model: torch.nn.Module, on: bool = True) -> None:
    """Runs the decoder stack of ``model`` under ``torch.autograd.graph.save_on_cpu(pin_memory=True)``: its saved
    activations wait for backward in pinned host memory (synchronous copies on the compute stream). Idempotent;
    ``on=False`` turns it off again (the auto mode's measurement tries both)."""
    target = unwrap_model(model)
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else target
    decoder._pair_dpo_offload_on = on
    if getattr(decoder, "_pair_dpo_offload", False) or not on:
        return
    inner = decoder.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        use = decoder._pair_dpo_offload_on and decoder.training and torch.is_grad_enabled()
        device_type = next(decoder.parameters()).device.type
        pin = device_type == "cuda"
        hooks = torch.autograd.graph.save_on_cpu(pin_memory=pin, device_type=device_type) if use else None
        with hooks if hooks is not None else contextlib.nullcontext():
            return inner(*args, **kwargs)

    decoder.forward = forward
    decoder._pair_dpo_offload = True
