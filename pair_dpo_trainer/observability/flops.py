"""The FLOP count the Trainer reports (``floating_point_ops``): 6 N per token for the policy's forward and backward,
2 N per token for each gradient-free forward (the reference, AOT's pre-pass), N the non-embedding parameters."""

from __future__ import annotations

import torch


def non_embedding_parameters(model: torch.nn.Module) -> int:
    """Parameters that do matmul work per token: every parameter outside ``nn.Embedding`` modules, plus the LM head's
    weight when it is tied to the input embedding (the head multiplies by it once per token either way). A ZeRO-3
    partitioned parameter counts at its full size.

    Example:
        >>> from transformers import Qwen2Config, Qwen2ForCausalLM
        >>> tied = Qwen2ForCausalLM(Qwen2Config(vocab_size=100, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
        >>> non_embedding_parameters(tied) - sum(p.numel() for p in tied.model.layers.parameters())  # head + norm
        1616
    """
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    head_weight = getattr(head, "weight", None)
    embedding = {
        id(p)
        for m in model.modules()
        if isinstance(m, torch.nn.Embedding)
        for p in m.parameters()
        if p is not head_weight
    }
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters() if id(p) not in embedding)


def flops_per_token_per_parameter(*, reference_forward: bool, prepass: bool) -> int:
    """FLOPs per token and parameter of one training micro-batch: 6 for the policy, +2 for an online reference
    forward, +2 (policy) and +2 more (reference) for a gradient-free pre-pass over the step (AOT's sort).

    Example:
        >>> flops_per_token_per_parameter(reference_forward=True, prepass=False)
        8
    """
    ref = 2 if reference_forward else 0
    return 6 + ref + ((2 + ref) if prepass else 0)
