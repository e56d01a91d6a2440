"""Finding a causal LM's repeated decoder layers (the unit of regional compilation and of ZeRO-3 leaf modules).

Details: modeling/README.md, "Module notes", ``layers.py``.
"""

from __future__ import annotations

import torch

from pair_dpo_trainer.modeling.wrappers import unwrap_model


def find_decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The repeated decoder layers of a transformers causal LM, or None when there are none to recognise.

    ``get_decoder().layers`` when it is a non-empty ``ModuleList`` (Llama, Qwen2/3, Mistral, Gemma, ... and PEFT or
    DDP wrappers of them), else the longest ``ModuleList`` of identical blocks whose class is named in the model's
    ``_no_split_modules`` (e.g. GPT-2's ``transformer.h``).

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        ...     num_attention_heads=2, vocab_size=64))
        >>> [type(layer).__name__ for layer in find_decoder_layers(model)]
        ['LlamaDecoderLayer', 'LlamaDecoderLayer', 'LlamaDecoderLayer']
    """
    target = unwrap_model(model)
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else target
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
        return layers
    block_names = set(getattr(target, "_no_split_modules", None) or ())
    candidates = [
        m
        for m in target.modules()
        if isinstance(m, torch.nn.ModuleList)
        and len(m) > 0
        and len({type(c) for c in m}) == 1
        and type(m[0]).__name__ in block_names
    ]
    return max(candidates, key=len) if candidates else None
