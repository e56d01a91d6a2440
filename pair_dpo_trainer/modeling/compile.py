"""Regional ``torch.compile`` of a causal LM's repeated decoder layers, for packed rows of varying shape.

Why regional, in place and dynamic:

Details: modeling/README.md, "Module notes", ``compile.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from pair_dpo_trainer.errors import ConfigError, Problem
from pair_dpo_trainer.modeling.layers import find_decoder_layers
from pair_dpo_trainer.modeling.wrappers import unwrap_model

COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
"""``torch_compile_mode`` values without CUDA graphs (None is "default")."""


def compile_mode_problem(mode: str | None) -> str | None:
    """Why ``torch_compile_mode=mode`` cannot compile packed rows, or None when it can."""
    if mode is None or mode in COMPILE_MODES:
        return None
    return (
        f"torch_compile_mode={mode!r} uses CUDA graphs, which need static shapes; packed rows change length every "
        "micro-batch, and even with pad_to_budget (one row length) the decoder layers are compiled one by one, so "
        "each layer's output is the next call's input of the same graph, which CUDA graph trees overwrite (PyTorch "
        f"pytorch/pytorch#152887): use one of {list(COMPILE_MODES)} or leave it unset."
    )


def compile_problems(*, torch_compile: bool, zero3: bool, attn_backend: str) -> list[Problem]:
    """``torch_compile=True`` with ZeRO-3 (its parameter hooks cannot be traced) or the host-synced SDPA kernel."""
    if not torch_compile:
        return []
    problems: list[Problem] = []
    if zero3:
        problems.append(
            (
                "unsupported_combination",
                "torch_compile=True is not supported with DeepSpeed ZeRO-3 (its per-module parameter hooks cannot be "
                "traced inside a compiled layer): set torch_compile=False, or use a single GPU, DDP or ZeRO-1/2.",
            )
        )
    if attn_backend == "sdpa_segments":
        problems.append(
            (
                "unsupported_combination",
                "torch_compile=True needs a varlen attention kernel (attn_backend 'torch_varlen' or 'flash_attn': a "
                "CUDA device with bf16/fp16); 'sdpa_segments' reads the segment bounds on the host, which splits every "
                "compiled layer into pieces that recompile as the packed rows change: set torch_compile=False here.",
            )
        )
    return problems


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The repeated decoder layers to compile (:func:`~pair_dpo_trainer.modeling.layers.find_decoder_layers`).

    Raises:
        ConfigError: ``compile_unsupported`` when no repeated block list is found.
    """
    layers = find_decoder_layers(model)
    if layers is None:
        raise ConfigError(
            "compile_unsupported",
            f"torch_compile=True compiles the repeated decoder layers, but {type(unwrap_model(model)).__name__} has "
            "none that pair_dpo_trainer recognises: set torch_compile=False.",
        )
    return layers


def compile_decoder_layers(
    model: torch.nn.Module,
    *,
    backend: str = "inductor",
    mode: str | None = None,
    dynamic: bool = True,
    fullgraph: bool = False,
) -> int:
    """Compile every decoder layer of ``model`` in place (idempotent); returns the number of layers compiled now.

    Args:
        model: A transformers causal LM (or a wrapper around one) using ``attn_implementation="pair_varlen"``.
        backend: ``torch.compile`` backend (``TrainingArguments.torch_compile_backend``).
        mode: ``torch.compile`` mode (``TrainingArguments.torch_compile_mode``); None is the default mode.
            ``"reduce-overhead"`` (CUDA graphs) needs static shapes and is refused.
        dynamic: Symbolic sequence dimensions from the first compile (see the module docstring).
        fullgraph: Fail on a graph break instead of splitting the layer (tests use it to prove there is none).

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> m = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, vocab_size=64))
        >>> compile_decoder_layers(m, backend="eager"), compile_decoder_layers(m, backend="eager")
        (2, 0)

    Raises:
        ConfigError: ``unsupported_combination`` for a CUDA-graph mode; ``compile_unsupported`` for a model
            without recognisable layers.
    """
    problem = compile_mode_problem(mode)
    if problem is not None:
        raise ConfigError("unsupported_combination", problem)
    options: dict[str, Any] = {"backend": backend, "dynamic": dynamic, "fullgraph": fullgraph}
    if mode not in (None, "default"):
        options["mode"] = mode
    compiled = 0
    for layer in decoder_layers(model):
        if getattr(layer, "_compiled_call_impl", None) is None:
            layer.compile(**options)
            compiled += 1
    return compiled


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether every decoder layer of ``model`` is compiled in place."""
    return all(getattr(layer, "_compiled_call_impl", None) is not None for layer in decoder_layers(model))
