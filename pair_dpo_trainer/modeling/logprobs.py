"""Per-sequence log-probabilities of completions, for packed rows (chunked) and padded rows (reference).

Details: modeling/README.md, "Module notes", ``logprobs.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from pair_dpo_trainer.collators.batch import IGNORE_INDEX, PackedPairBatch, split_pairs
from pair_dpo_trainer.collators.padded import PaddedPairBatch
from pair_dpo_trainer.errors import ConfigError
from pair_dpo_trainer.modeling.attention import PAIR_VARLEN, packed_forward_kwargs
from pair_dpo_trainer.modeling.wrappers import forward_replaced, is_fsdp_managed, unwrap_model

DEFAULT_CHUNK_SIZE = 4096
"""Rows of hidden states projected onto the vocabulary at once."""

_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


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


def check_supported_head(model: torch.nn.Module) -> Any:
    """Return the LM head of ``model`` after checking that logits are a plain ``hidden @ weight.T``.

    Raises:
        ConfigError: ``logit_transform_unsupported`` when the config soft-caps or scales the final logits
            (Gemma2/3 ``final_logit_softcapping``, Cohere ``logit_scale``, Granite ``logits_scaling``) or the
            head has a bias: the chunked path would silently compute different values.
    """
    target = unwrap_model(model)
    config = target.config
    for name in _LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        neutral = value is None or (name != "final_logit_softcapping" and float(value) == 1.0)
        if not neutral:
            raise ConfigError(
                "logit_transform_unsupported",
                f"{type(target).__name__} sets config.{name}={value!r}; chunked log-probs do not support it",
            )
    head = target.get_output_embeddings()
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise ConfigError("logit_transform_unsupported", f"{type(target).__name__} has no linear output head")
    if getattr(head, "bias", None) is not None:
        raise ConfigError("logit_transform_unsupported", "an LM head with a bias is not supported yet")
    return head


def _check_varlen(model: torch.nn.Module, batch: PackedPairBatch) -> Any:
    """The unwrapped model, after checking that its attention isolates the packed sequences (``attn_not_varlen``)
    and, for a shared-prompt row, that it reads the gathered key segments (only ``pair_varlen`` does)."""
    target = unwrap_model(model)
    implementation = str(target.config._attn_implementation)
    if batch.shares_prompt and implementation != PAIR_VARLEN:
        raise ConfigError(
            "attn_not_varlen",
            f"a shared-prompt row (share_prompt) needs attn_implementation={PAIR_VARLEN!r}, got {implementation!r}",
        )
    if implementation != PAIR_VARLEN and not implementation.startswith("flash_attention"):
        raise ConfigError(
            "attn_not_varlen",
            f"packed forwards need attn_implementation={PAIR_VARLEN!r} (enable_pair_varlen(model)), "
            f"got {implementation!r}",
        )
    return target


def in_forward_token_logps(
    model: torch.nn.Module,
    head: Any,
    batch: PackedPairBatch,
    targets: torch.Tensor,
    chunk_size: int,
    *,
    with_stats: bool = False,
    positions: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of the scored positions, computed inside the model's own (single) call of ``head``.

    For FSDP2 modules: outside its unit's forward the head weight is a sharded DTensor; inside it is the all-gathered
    weight, and FSDP's hooks (all-gather, reshard, the backward pre-hook that gathers it again) fire once, as for any
    forward. The model selects the scored rows itself (``logits_to_keep=batch.completion_positions``, ``[1, P, H]``)
    and its head call returns :func:`chunked_token_logps` of them instead of logits: ``[P]`` float32, not a view
    (FSDP warns about view outputs).

    Args:
        model: The (FSDP2-sharded) causal LM with ``pair_varlen`` attention.
        head: Its output embedding (:func:`check_supported_head`).
        batch: Packed micro-batch on the model's device.
        targets: ``[P]`` int64 target ids of ``batch.completion_positions``.
        chunk_size: Rows per chunk.
        with_stats: Also return the per-token :data:`TOKEN_STATS` (the head call then returns one ``[P, 5]`` tensor,
            log-probs first, so the model's own code sees a single "logits" tensor; only the log-probs carry gradient).
        positions: The rows to score (default ``batch.completion_positions``), aligned with ``targets``.
    """
    _check_varlen(model, batch)

    def chunked_forward(rows: torch.Tensor) -> Any:
        result = chunked_token_logps(
            rows.reshape(-1, rows.shape[-1]), head.weight, targets, chunk_size, with_stats=with_stats
        )
        return torch.cat([result[0][:, None], result[1]], dim=1) if with_stats else result

    keep = batch.completion_positions if positions is None else positions
    with forward_replaced(head, chunked_forward):
        output = model(**packed_forward_kwargs(batch), logits_to_keep=keep)
    if not with_stats:
        return output.logits.reshape(-1)
    columns = output.logits.reshape(-1, 1 + len(TOKEN_STATS))
    return columns[:, 0], columns[:, 1:].detach()


def packed_hidden_states(model: torch.nn.Module, batch: PackedPairBatch) -> torch.Tensor:
    """Run the packed forward and return the final (post-norm) hidden states ``[1, T, H]``.

    The call goes through ``model`` itself (wrappers included) with ``use_cache=False``, varlen boundaries and
    an empty ``logits_to_keep``; the hidden states come from a forward hook on ``get_decoder()``.

    Raises:
        ConfigError: ``attn_not_varlen`` unless the model uses ``pair_varlen`` (or a transformers flash
            implementation, which also honours ``cu_seq_lens_q``): other implementations would let packed
            sequences attend to each other or build a dense ``[T, T]`` mask.
    """
    target = _check_varlen(model, batch)
    captured: list[torch.Tensor] = []

    def _capture(_module: torch.nn.Module, _args: Any, output: Any) -> None:
        captured.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    handle = target.get_decoder().register_forward_hook(_capture)
    try:
        no_logits = torch.empty(0, dtype=torch.int64, device=batch.input_ids.device)
        model(**packed_forward_kwargs(batch), logits_to_keep=no_logits)
    finally:
        handle.remove()
    return captured[-1]


@dataclass(frozen=True)
class SequenceLogps:
    """The policy pass of one packed micro-batch, per sequence (``[2n]`` in sequence order: chosen, rejected, ...).

    Attributes:
        logps: Summed completion-token log-probs, LD-DPO weighted when ``batch.token_weights`` is set.
        nll_logps: The plain sums (the same tensor as ``logps`` without token weights), for NLL terms.
        token_stats: ``[2n, 4]`` detached per-sequence sums over the scored tokens of: the mean logit, the entropy,
            the target-is-argmax indicator and ``log p_t - log sum_v p_v^2`` (WPO); None without statistics.
        prompt_logps: Summed log-probs of the chosen sequences' prompt tokens after the first (0 for rejected
            sequences), when the batch lists them (``prompt_positions``, ORPO); else None.
        prompt_token_counts: The number of those prompt tokens per sequence, else None.
    """

    logps: torch.Tensor
    nll_logps: torch.Tensor
    token_stats: torch.Tensor | None = None
    prompt_logps: torch.Tensor | None = None
    prompt_token_counts: torch.Tensor | None = None


@dataclass(frozen=True)
class _ScoredTokens:
    """The log-probs of a batch's scored positions: completion tokens (with statistics), then prompt tokens."""

    token_logps: torch.Tensor
    stats: torch.Tensor | None
    sequences: torch.Tensor
    prompt_logps: torch.Tensor | None = None
    prompt_sequences: torch.Tensor | None = None


def _scored_token_logps(
    model: torch.nn.Module, batch: PackedPairBatch, chunk_size: int, with_stats: bool, *, prompts: bool = False
) -> _ScoredTokens:
    """The log-probs of the batch's completion positions (``[N]``, statistics ``[N, 4] | None``, their sequences)
    and, with ``prompts`` and a batch that lists them, of its ``prompt_positions`` (one pass over both)."""
    head = check_supported_head(model)
    positions, targets, sequences = batch.completion_positions, batch.scored_targets(), batch.scored_sequences()
    scored = int(positions.shape[0])  # host-known shape: no sync
    extra = batch.prompt_positions if prompts else None
    if extra is not None:
        positions = torch.cat([positions, extra])
        targets = torch.cat([targets, cast(torch.Tensor, batch.prompt_targets)])
        sequences = torch.cat([sequences, batch.sequence_index.reshape(-1).index_select(0, extra)])
    if is_fsdp_managed(model):  # FSDP2: the head weight is whole only inside the model's own head call
        result = in_forward_token_logps(
            model, head, batch, targets, chunk_size, with_stats=with_stats, positions=positions
        )
    else:
        hidden = packed_hidden_states(model, batch)
        rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)
        if hasattr(head.weight, "ds_id"):  # a ZeRO-3 partitioned parameter: let DeepSpeed's module hooks gather it
            result = module_chunked_token_logps(head, rows, targets, chunk_size, with_stats=with_stats)
        else:
            result = chunked_token_logps(rows, head.weight, targets, chunk_size, with_stats=with_stats)
    token_logps, stats = cast(tuple[torch.Tensor, torch.Tensor | None], result if with_stats else (result, None))
    if extra is None:
        return _ScoredTokens(token_logps, stats, sequences)
    return _ScoredTokens(
        token_logps[:scored],
        None if stats is None else stats[:scored],
        sequences[:scored],
        prompt_logps=token_logps[scored:],
        prompt_sequences=sequences[scored:],
    )


def _sequence_sums(values: torch.Tensor, sequences: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """Per-sequence sums of per-token ``values`` (``[N]`` or ``[N, k]``, returned in their dtype) with ``index_add``
    (no host sync), accumulated in float64.

    CUDA's ``index_add`` adds atomically, in an order that varies from run to run. A float32 accumulator would round
    differently in each order, so a policy and its identical reference would not give the same sums at step 0 (the
    loss would miss ln 2 by a few 1e-5); float64 partial sums (order error ~1e-16 relative) round to the same float32
    value in any order, and to the correctly rounded sum.
    """
    sums = torch.zeros((num_sequences, *values.shape[1:]), dtype=torch.float64, device=values.device)
    return sums.index_add(0, sequences, values.to(torch.float64)).to(values.dtype)


def packed_sequence_logps(
    model: torch.nn.Module, batch: PackedPairBatch, *, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> torch.Tensor:
    """Per-sequence sums of completion-token log-probs for a packed row (weighted by ``batch.token_weights`` when
    the trainer set them for LD-DPO, so every reference backend applies the same weighting as the policy).

    Args:
        model: Causal LM with ``attn_implementation="pair_varlen"`` (policy or reference; wrappers allowed).
        batch: Packed micro-batch on the model's device.
        chunk_size: Scored tokens projected onto the vocabulary at once.

    Returns:
        ``[2n]`` float32 log-probs in sequence order (chosen, rejected, chosen, ...); see
        :func:`~pair_dpo_trainer.collators.batch.split_pairs`.

    Raises:
        ConfigError: see :func:`check_supported_head` and :func:`packed_hidden_states`.
    """
    scored = _scored_token_logps(model, batch, chunk_size, with_stats=False)
    token_logps = scored.token_logps
    if batch.token_weights is not None:
        token_logps = token_logps * batch.token_weights.to(token_logps.dtype)
    return _sequence_sums(token_logps, scored.sequences, batch.num_sequences)


def packed_policy_logps(
    model: torch.nn.Module, batch: PackedPairBatch, *, chunk_size: int = DEFAULT_CHUNK_SIZE, with_stats: bool = True
) -> SequenceLogps:
    """The policy's per-sequence log-probs and, with ``with_stats``, the per-token statistics summed per sequence
    (computed inside the chunked head: no ``[T, V]`` tensor, no host sync); with the chosen prompts' log-probs when
    the batch lists them (``prompt_positions``). Shapes and errors as :func:`packed_sequence_logps`."""
    scored = _scored_token_logps(model, batch, chunk_size, with_stats=with_stats, prompts=True)
    logps = sequence_logps_from_tokens(scored.token_logps, scored.stats, scored.sequences, batch)
    if scored.prompt_logps is None or scored.prompt_sequences is None:
        return logps
    n = batch.num_sequences
    ones = torch.ones_like(scored.prompt_logps)
    return replace(
        logps,
        prompt_logps=_sequence_sums(scored.prompt_logps, scored.prompt_sequences, n),
        prompt_token_counts=_sequence_sums(ones, scored.prompt_sequences, n),
    )


def sequence_logps_from_tokens(
    token_logps: torch.Tensor, stats: torch.Tensor | None, sequences: torch.Tensor, batch: PackedPairBatch
) -> SequenceLogps:
    """Per-sequence sums of the scored tokens' log-probs (plain, and LD-weighted by ``batch.token_weights``) and of
    their :data:`TOKEN_STATS` (``[N]``, ``[N, 4] | None``, ``sequences [N]`` in ``completion_positions`` order)."""
    n = batch.num_sequences
    plain = _sequence_sums(token_logps, sequences, n)
    if batch.token_weights is None:
        logps = plain
    else:
        logps = _sequence_sums(token_logps * batch.token_weights.to(token_logps.dtype), sequences, n)
    if stats is not None:
        stats = stats.clone()
        stats[:, 3] = token_logps.detach() - stats[:, 3]  # WPO: log p_t - log sum_v p_v^2
        stats = _sequence_sums(stats, sequences, n)
    return SequenceLogps(logps=logps, nll_logps=plain, token_stats=stats)


def length_desensitized_weights(batch: PackedPairBatch, alpha: float) -> torch.Tensor:
    """LD-DPO per-token weights of the scored positions: 1 for the first ``min(|y_w|, |y_l|)`` tokens of each
    completion (the length both completions of the pair share), ``alpha`` for the longer completion's tail.

    Liu et al. 2024, "Length Desensitization in Direct Preference Optimization", arXiv:2409.06411, the
    length-desensitised likelihood of its method section (Sec. 4):
    ``log pi_hat(y|x) = sum_{t <= l_p} log p_t + alpha * sum_{t > l_p} log p_t`` with ``l_p = min(|y_w|, |y_l|)``.
    Device ops only (``index_add`` / ``cumsum``): no host sync. Shape ``[N]`` (``batch.completion_positions``),
    float64 so that ``alpha`` is exact (cast to the log-probs' dtype where it is applied).
    """
    sequences = batch.scored_sequences()
    n = batch.num_sequences
    ones = torch.ones_like(sequences, dtype=torch.float64)
    counts = torch.zeros(n + 1, dtype=torch.float64, device=ones.device).index_add_(0, sequences, ones)[:n]
    starts = counts.cumsum(0) - counts
    rank = torch.arange(sequences.shape[0], device=ones.device, dtype=torch.float64) - starts[sequences]
    shared = torch.minimum(*split_pairs(counts)).repeat_interleave(2)
    return torch.where(rank < shared[sequences], ones, ones * alpha)


def with_length_desensitization(batch: PackedPairBatch, alpha: float | None) -> PackedPairBatch:
    """``batch`` carrying the LD-DPO token weights for ``alpha`` (unchanged for None)."""
    if alpha is None:
        return batch
    return replace(batch, token_weights=length_desensitized_weights(batch, alpha))


def padded_sequence_logps(model: torch.nn.Module, batch: PaddedPairBatch) -> torch.Tensor:
    """Reference path: full logits of ``2n`` padded rows, ``log_softmax``, masked sum per row.

    Args:
        model: Causal LM with any attention implementation that honours a 2D ``attention_mask`` (sdpa, eager).
        batch: Padded micro-batch on the model's device.

    Returns:
        ``[2n]`` float32 log-probs in the same order as :func:`packed_sequence_logps`.
    """
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    logps = logits.to(_acc_dtype(logits.dtype)).log_softmax(dim=-1)
    targets = batch.labels.clamp(min=0)[..., None]
    token_logps = logps.gather(-1, targets).squeeze(-1)
    return (token_logps * batch.completion_mask).sum(dim=-1)


__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "IGNORE_INDEX",
    "TOKEN_STATS",
    "SequenceLogps",
    "check_supported_head",
    "chunked_token_logps",
    "in_forward_token_logps",
    "module_chunked_token_logps",
    "length_desensitized_weights",
    "naive_token_logps",
    "naive_token_stats",
    "packed_hidden_states",
    "packed_policy_logps",
    "packed_sequence_logps",
    "padded_sequence_logps",
    "sequence_logps_from_tokens",
    "with_length_desensitization",
]
