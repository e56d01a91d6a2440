"""Modeling helpers: varlen attention for packed rows (``attn_implementation="pair_varlen"``)."""

from pair_dpo_trainer.modeling.attention import (
    BACKENDS,
    PAIR_VARLEN,
    enable_pair_varlen,
    packed_forward_kwargs,
    pair_varlen_attention_forward,
    register_pair_varlen,
    select_attn_backend,
    varlen_attention,
)

__all__ = [
    "BACKENDS",
    "PAIR_VARLEN",
    "enable_pair_varlen",
    "packed_forward_kwargs",
    "pair_varlen_attention_forward",
    "register_pair_varlen",
    "select_attn_backend",
    "varlen_attention",
]
