"""A traceable CPU stand-in for the CUDA varlen kernel, so the compiled path can be tested without a GPU.

``torch_varlen`` runs only on CUDA, and ``sdpa_segments`` (the CPU kernel) reads the segment bounds on the host, which
``torch_compile`` refuses. :func:`block_mask_varlen_attn` computes the same attention with a dense block-causal mask
(``O(T^2)`` memory: tests and tiny models only); :func:`install_traceable_varlen` makes it the ``torch_varlen`` kernel
for one test (through pytest's ``monkeypatch``, which undoes it).
"""

from __future__ import annotations

from typing import Any

import torch


def block_mask_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """``torch.nn.attention.varlen.varlen_attn`` semantics with dense SDPA and a block-causal mask (traceable, CPU):
    query segment ``s`` (``cu_q``) attends to key segment ``s`` (``cu_k``), causal aligned bottom-right."""
    import torch.nn.functional as F

    seg_q, offset_q, length_q = _segments(cu_q, q.shape[0], q.device)
    seg_k, offset_k, length_k = _segments(cu_k, k.shape[0], q.device)
    # query i of a segment sees key j of its key segment when j <= i + (Lk - Lq): bottom-right causal
    reach = offset_q + (length_k.index_select(0, seg_q) - length_q.index_select(0, seg_q))
    mask = seg_q[:, None] == seg_k[None, :]
    if window_size[1] == 0:
        mask &= offset_k[None, :] <= reach[:, None]
    if window_size[0] >= 0:
        mask &= (reach[:, None] - offset_k[None, :]) <= window_size[0]
    groups = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


def _segments(cu: torch.Tensor, total: int, device: torch.device):
    """``(segment, offset in it, segment lengths)`` of ``total`` packed tokens with boundaries ``cu``."""
    cu = cu.to(torch.int64)
    pos = torch.arange(total, device=device)
    seg = torch.searchsorted(cu[1:], pos, right=True)
    return seg, pos - cu.index_select(0, seg), cu[1:] - cu[:-1]


def install_traceable_varlen(monkeypatch: Any) -> str:
    """Makes attention backend ``torch_varlen`` available on the CPU with :func:`block_mask_varlen_attn` as its kernel
    (undone by ``monkeypatch``); returns the backend name."""
    from pair_dpo_trainer.modeling import attention

    monkeypatch.setattr(attention, "_RESOLVED", {})
    monkeypatch.setitem(attention._KERNELS, "torch_varlen", block_mask_varlen_attn)
    monkeypatch.setitem(attention._GQA_KWARGS, "torch_varlen", True)
    real = attention._unavailable_reason
    monkeypatch.setattr(
        attention, "_unavailable_reason", lambda b, d, t: None if b == "torch_varlen" else real(b, d, t)
    )
    return "torch_varlen"
