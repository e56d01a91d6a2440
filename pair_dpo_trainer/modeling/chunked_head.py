"""The chunked LM head: log-probs of target tokens projected onto the vocabulary a chunk of rows at a time, in a
custom autograd function that recomputes each chunk in backward (no ``[N, V]`` tensor), its optional per-token
statistics, its element-wise kernels (eager or compiled) and the naive references tests compare it with.

Details: modeling/README.md, "Module notes", ``chunked_head.py``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from pair_dpo_trainer.modeling.wrappers import forward_replaced

DEFAULT_CHUNK_SIZE = 4096
"""Rows of hidden states projected onto the vocabulary at once."""


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of log-probs and accumulators: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[c, H] x [V, H] -> [c, V]`` logits in the input dtype (as the model's head), cast to ``dtype``."""
    return (hidden @ weight.t()).to(dtype)


TOKEN_STATS = ("mean_logit", "entropy", "is_top1", "log_sum_sq_probs")
"""Columns of the per-token statistics :func:`chunked_token_logps` returns with ``with_stats=True`` (no gradient):
the mean logit over the vocabulary (TRL's ``logits/*`` metrics), the entropy of the next-token distribution, 1.0
where the target is the argmax, and ``log sum_v p_v^2`` (WPO's normalisation)."""


def _chunk_stats(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lse [c], stats [c, 4])`` of one ``[c, V]`` chunk, with one ``[c, V]`` temporary besides the logits."""
    top = logits.max(dim=-1)
    exp = (logits - top.values[:, None]).exp_()
    total = exp.sum(dim=-1)
    lse = top.values + total.log()
    weighted = torch.bmm(exp[:, None, :], logits[:, :, None]).reshape(-1)  # sum_v e_v z_v without a [c, V] product
    squares = torch.bmm(exp[:, None, :], exp[:, :, None]).reshape(-1)
    stats = torch.stack(
        [
            logits.mean(dim=-1),
            lse - weighted / total,
            (top.indices == targets).to(logits.dtype),
            squares.log() - 2.0 * total.log(),
        ],
        dim=1,
    )
    return lse, stats


class _ChunkedTokenLogps(torch.autograd.Function):
    """``log_softmax(hidden @ weight.T)[i, targets[i]]`` chunk by chunk; backward recomputes each chunk.

    With ``with_stats`` the forward also returns the :data:`TOKEN_STATS` of every row (non-differentiable; an
    empty ``[0, 4]`` tensor otherwise). Backward is the same either way.
    """

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int, with_stats: bool
    ):
        dtype = _acc_dtype(hidden.dtype)
        total = hidden.shape[0]
        logps = hidden.new_empty(total, dtype=dtype)
        lse = hidden.new_empty(total, dtype=dtype)
        stats = hidden.new_empty((total if with_stats else 0, len(TOKEN_STATS)), dtype=dtype)
        kernels = _HEAD_KERNELS
        for start in range(0, total, chunk_size):
            end = min(start + chunk_size, total)
            logits = hidden[start:end] @ weight.t()  # [c, V] in the head's dtype
            if with_stats:
                logps[start:end], lse[start:end], stats[start:end] = kernels["stats"](logits, targets[start:end], dtype)
            else:
                logps[start:end], lse[start:end] = kernels["plain"](logits, targets[start:end], dtype)
            del logits
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(stats)
        return logps, stats

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_logps: torch.Tensor, _grad_stats: torch.Tensor | None):
        hidden, weight, targets, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        dtype = lse.dtype
        grad_logps = grad_logps.to(dtype)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, hidden.shape[0])
            logits = hidden[start:end] @ weight.t()
            dlogits = _HEAD_KERNELS["dlogits"](logits, lse[start:end], targets[start:end], grad_logps[start:end])
            del logits
            if grad_hidden is not None:
                grad_hidden[start:end] = dlogits @ weight
            if grad_weight is not None and dlogits.dtype == dtype:
                grad_weight.addmm_(dlogits.t(), hidden[start:end])
            elif grad_weight is not None:
                grad_weight += (dlogits.t() @ hidden[start:end]).to(dtype)
            del dlogits
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def _plain_kernel(logits: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype):
    """``(logp [c], lse [c])`` of one ``[c, V]`` chunk of head-dtype logits, computed in ``dtype``."""
    logits = logits.to(dtype)
    lse = torch.logsumexp(logits, dim=-1)
    return logits.gather(1, targets[:, None]).squeeze(1) - lse, lse


def _stats_kernel(logits: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype):
    """``(logp [c], lse [c], stats [c, 4])`` of one chunk (eager: one ``[c, V]`` temporary besides the logits)."""
    logits = logits.to(dtype)
    lse, stats = _chunk_stats(logits, targets)
    return logits.gather(1, targets[:, None]).squeeze(1) - lse, lse, stats


def _fused_stats_kernel(logits: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype):
    """:func:`_stats_kernel` written as element-wise ops and reductions over the vocabulary, for the compiler to fuse
    into a few passes over the head-dtype logits (no float32 ``[c, V]`` copy is materialised)."""
    z = logits.to(dtype)
    top = z.max(dim=-1)
    exp = (z - top.values[:, None]).exp()
    total = exp.sum(dim=-1)
    lse = top.values + total.log()
    stats = torch.stack(
        [
            z.mean(dim=-1),
            lse - (exp * z).sum(dim=-1) / total,
            (top.indices == targets).to(dtype),
            (exp * exp).sum(dim=-1).log() - 2.0 * total.log(),
        ],
        dim=1,
    )
    return z.gather(1, targets[:, None]).squeeze(1) - lse, lse, stats


def _dlogits_kernel(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor):
    """``grad * (onehot(t) - softmax(logits))`` of one chunk, in the head's dtype: d logp_t / d logits, scaled."""
    dlogits = logits.to(lse.dtype).sub_(lse[:, None]).exp_()
    dlogits.mul_(-grad[:, None]).scatter_add_(1, targets[:, None], grad[:, None])
    return dlogits.to(logits.dtype)


def _fused_dlogits_kernel(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor):
    """:func:`_dlogits_kernel` without in-place ops, for the compiler to fuse into one pass over the logits."""
    probs = (logits.to(lse.dtype) - lse[:, None]).exp()
    onehot = torch.arange(logits.shape[1], device=logits.device)[None, :] == targets[:, None]
    return (grad[:, None] * (onehot.to(lse.dtype) - probs)).to(logits.dtype)


_EAGER_HEAD_KERNELS: dict[str, Any] = {"plain": _plain_kernel, "stats": _stats_kernel, "dlogits": _dlogits_kernel}
_HEAD_KERNELS: dict[str, Any] = dict(_EAGER_HEAD_KERNELS)
"""The element-wise work of every vocabulary chunk (the matmuls stay outside): eager, or compiled by
:func:`compile_head_kernels`."""


def compile_head_kernels(backend: str = "inductor") -> None:
    """Compiles the chunked head's element-wise work (softmax statistics, the gradient of the logits) so that each
    chunk makes a few fused passes over its ``[c, V]`` logits instead of one per op; the matmuls are unchanged.
    Process-wide and idempotent (``torch_compile=True`` calls it); :func:`eager_head_kernels` undoes it."""
    if _HEAD_KERNELS["plain"] is not _EAGER_HEAD_KERNELS["plain"]:
        return
    options: dict[str, Any] = {"backend": backend, "dynamic": True}
    _HEAD_KERNELS.update(
        plain=torch.compile(_plain_kernel, **options),
        stats=torch.compile(_fused_stats_kernel, **options),
        dlogits=torch.compile(_fused_dlogits_kernel, **options),
    )


def eager_head_kernels() -> None:
    """The eager element-wise work again (tests compare both)."""
    _HEAD_KERNELS.update(_EAGER_HEAD_KERNELS)


def chunked_token_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    with_stats: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target token, computed ``chunk_size`` rows at a time.

    No ``[N, V]`` tensor exists in forward or backward; only ``[chunk_size, V]`` temporaries (with ``with_stats``,
    the same number: the statistics reuse the chunk's ``exp(logits - max)``).

    Args:
        hidden: ``[N, H]`` final hidden states (any float dtype; cast to ``weight.dtype``).
        weight: ``[V, H]`` output-embedding (LM head) weight.
        targets: ``[N]`` int64 target ids, all in ``[0, V)`` (not checked: no host sync).
        chunk_size: Rows per chunk (need not divide ``N``).
        with_stats: Also return the per-token :data:`TOKEN_STATS`.

    Returns:
        ``[N]`` log-probs, float32 (float64 for float64 inputs), differentiable w.r.t. ``hidden`` and ``weight``;
        with ``with_stats``, ``(logps, stats [N, 4])`` (stats without gradient).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    logps, stats = _ChunkedTokenLogps.apply(hidden.to(weight.dtype), weight, targets, int(chunk_size), with_stats)
    return (logps, stats) if with_stats else logps


def naive_token_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Reference for :func:`chunked_token_logps`: full ``[N, V]`` logits, ``log_softmax`` and ``gather``.

    Args:
        hidden: ``[N, H]``.
        weight: ``[V, H]``.
        targets: ``[N]`` int64.

    Returns:
        ``[N]`` log-probs, float32 (float64 for float64 inputs).
    """
    logits = F.linear(hidden.to(weight.dtype), weight).to(_acc_dtype(weight.dtype))
    return logits.log_softmax(dim=-1).gather(1, targets[:, None]).squeeze(1)


def naive_token_stats(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Reference for the ``with_stats`` output of :func:`chunked_token_logps`: full ``[N, V]`` logits.

    Returns:
        ``[N, 4]`` :data:`TOKEN_STATS`, float32 (float64 for float64 inputs).
    """
    logits = F.linear(hidden.to(weight.dtype), weight).to(_acc_dtype(weight.dtype))
    log_probs = logits.log_softmax(dim=-1)
    probs = log_probs.exp()
    entropy = -(probs * log_probs).sum(dim=-1)
    top1 = (logits.argmax(dim=-1) == targets).to(logits.dtype)
    return torch.stack([logits.mean(dim=-1), entropy, top1, (probs**2).sum(dim=-1).log()], dim=1)


def module_chunked_token_logps(
    head: Any,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    with_stats: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """As :func:`chunked_token_logps`, run as ONE call of the ``head`` module, so that module hooks fire exactly once.

    Under DeepSpeed ZeRO-3 the head's pre-forward hook all-gathers its partitioned weight (a collective) and its
    backward hook gathers it again. The call count must not depend on this rank's data: calling the head once per
    chunk made ranks with different numbers of scored tokens issue different numbers of gathers, which deadlocks
    NCCL (gloo reports a collective mismatch). Here the head is called once, with its ``forward`` temporarily
    replaced by the chunked computation on ``head.weight`` (the gathered weight inside the call; backward recomputes
    each chunk as :func:`chunked_token_logps` does). Shapes and dtypes as :func:`chunked_token_logps`.
    """

    def chunked_forward(rows: torch.Tensor, ids: torch.Tensor) -> Any:
        return chunked_token_logps(rows, head.weight, ids, chunk_size, with_stats=with_stats)

    with forward_replaced(head, chunked_forward):
        return head(hidden, targets)


__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "TOKEN_STATS",
    "chunked_token_logps",
    "compile_head_kernels",
    "eager_head_kernels",
    "module_chunked_token_logps",
    "naive_token_logps",
    "naive_token_stats",
]
