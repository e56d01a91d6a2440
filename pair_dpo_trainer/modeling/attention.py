"""Varlen attention for packed rows, registered in transformers as ``attn_implementation="pair_varlen"``.

How it plugs into transformers 5.x (checked in 5.17 and 5.24):

Details: modeling/README.md, "Module notes", ``attention.py``.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from pair_dpo_trainer.errors import ConfigError, Problem
from pair_dpo_trainer.modeling.sequence_parallel import gather_sequence, module_sequence_parallel, scatter_sequence
from pair_dpo_trainer.modeling.wrappers import unwrap_model

if TYPE_CHECKING:
    from pair_dpo_trainer.collators.batch import PackedPairBatch

logger = logging.getLogger(__name__)

PAIR_VARLEN = "pair_varlen"
"""The ``attn_implementation`` name registered in transformers' ``AttentionInterface``."""

BACKENDS = ("flash_attn", "torch_varlen", "sdpa_segments")
"""Concrete backends, best first; ``"auto"`` picks the first available one."""

ATTN_BACKENDS = ("auto", *BACKENDS)
"""The values of ``attn_backend``."""

KV_INDEX_KWARG = "pair_kv_index"
"""Forward keyword of the shared-prompt layout: the row positions gathered into each layer's keys and values."""


def attn_backend_problems(attn_backend: str) -> list[Problem]:
    """``bad_attn_backend`` when ``attn_backend`` is not one of :data:`ATTN_BACKENDS`."""
    if attn_backend in ATTN_BACKENDS:
        return []
    return [("bad_attn_backend", f"attn_backend={attn_backend!r}: use one of {list(ATTN_BACKENDS)}.")]


_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
_BACKEND_ATTR = "_pair_varlen_backend"
_logged_auto: set[tuple[str, str]] = set()


@functools.lru_cache(maxsize=1)
def _flash_attn_varlen_func() -> Callable[..., torch.Tensor] | None:
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # noqa: BLE001 - missing package or a broken build (ABI mismatch): both mean unavailable
        return None
    return flash_attn_varlen_func


@functools.lru_cache(maxsize=1)
def _torch_varlen_attn() -> tuple[Callable[..., Any], bool] | None:
    """``(varlen_attn, accepts_enable_gqa)`` or None. Imported only when a CUDA device asks for it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


def _unavailable_reason(backend: str, device: torch.device, dtype: torch.dtype | None) -> str | None:
    """Why ``backend`` cannot run on ``device`` / ``dtype``, or None when it can."""
    if backend == "sdpa_segments":
        return None
    if device.type != "cuda":
        return f"{backend} needs a CUDA device, got {device}"
    if dtype is not None and dtype not in _KERNEL_DTYPES:
        return f"{backend} needs fp16/bf16 activations, got {dtype}"
    if backend == "flash_attn":
        if _flash_attn_varlen_func() is None:
            return "the flash_attn package does not import (install it: pip install 'pair_dpo_trainer[flash]')"
        return None
    if _torch_varlen_attn() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (needs torch >= 2.10)"
    return None


def select_attn_backend(
    requested: str = "auto", device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> str:
    """Resolve an attention backend name for ``device`` (and optionally the activation ``dtype``).

    Args:
        requested: ``"auto"``, ``"flash_attn"``, ``"torch_varlen"`` or ``"sdpa_segments"``.
        device: Device the attention runs on (default: CUDA if available, else CPU).
        dtype: Activation dtype, if known: the CUDA kernels need fp16/bf16.

    Returns:
        One of :data:`BACKENDS`. ``"auto"`` picks the first available one and logs the choice once per
        device type.

    Raises:
        ConfigError: ``unknown_attn_backend`` for a name not listed above; ``attn_backend_unavailable`` when
            an explicitly requested backend cannot run here.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if requested == "auto":
        choice = next(b for b in BACKENDS if _unavailable_reason(b, device, dtype) is None)
        if (device.type, choice) not in _logged_auto:
            _logged_auto.add((device.type, choice))
            logger.info("pair_varlen attention: auto-selected backend %r on %s", choice, device.type)
        return choice
    if requested not in BACKENDS:
        raise ConfigError("unknown_attn_backend", f"attn_backend={requested!r} is not one of {('auto', *BACKENDS)}")
    reason = _unavailable_reason(requested, device, dtype)
    if reason is not None:
        raise ConfigError(
            "attn_backend_unavailable",
            f"attn_backend={requested!r} is unavailable: {reason}; or set attn_backend='auto' (the best available "
            "kernel) or 'sdpa_segments'",
        )
    return requested


_RESOLVED: dict[tuple[str, torch.device, torch.dtype], str] = {}


@torch.compiler.assume_constant_result  # under torch.compile: evaluated once at trace time, a constant in the graph
def _resolve_cached(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """:func:`select_attn_backend`, cached per ``(requested, device, dtype)``; loads the kernel too."""
    key = (requested, device, dtype)
    backend = _RESOLVED.get(key)
    if backend is None:
        backend = select_attn_backend(requested, device, dtype)
        _kernel(backend)  # import and introspect outside any traced region
        _RESOLVED[key] = backend
    return backend


_KERNELS: dict[str, Callable[..., torch.Tensor]] = {}
"""Loaded varlen kernels by backend name; the hot path reads this dict (no imports or introspection there)."""
_GQA_KWARGS: dict[str, bool] = {}


def _kernel(backend: str) -> Callable[..., torch.Tensor]:
    """The varlen kernel of ``backend`` (``flash_attn`` / ``torch_varlen``), loaded on first use."""
    kernel = _KERNELS.get(backend)
    if kernel is None:
        if backend == "flash_attn":
            kernel, gqa = _flash_attn_varlen_func(), False
        elif backend == "torch_varlen":
            kernel, gqa = _torch_varlen_attn() or (None, False)
        else:
            return None  # type: ignore[return-value]  # sdpa_segments needs no kernel
        if kernel is None:
            raise ConfigError("attn_backend_unavailable", f"attention backend {backend!r} is not installed")
        _KERNELS[backend], _GQA_KWARGS[backend] = kernel, gqa
    return kernel


def register_pair_varlen() -> str:
    """Register :func:`pair_varlen_attention_forward` as ``"pair_varlen"`` (idempotent); return the name."""
    AttentionInterface.register(PAIR_VARLEN, pair_varlen_attention_forward)
    return PAIR_VARLEN


def enable_pair_varlen(model: torch.nn.Module, backend: str = "auto", device: torch.device | str | None = None) -> str:
    """Switch ``model`` to ``attn_implementation="pair_varlen"`` with the given backend.

    The backend is stored on the model's modules and resolved at each attention call for the device and dtype
    the attention actually runs on (cached), so the model may be moved or cast after this call, and AMP
    (fp32 weights, bf16 activations) works. Here only the device is validated.

    Args:
        model: A transformers causal LM (or a wrapper around one).
        backend: ``"auto"`` or one of :data:`BACKENDS`.
        device: Device the model will run on. Default: the device of its parameters, or, while they are
            still on the CPU, the CUDA device when one is available (a trainer moves the model later).

    Returns:
        The backend expected on ``device`` for fp16/bf16 activations (for logs; fp32 activations on CUDA run
        ``sdpa_segments`` under ``"auto"``).

    Raises:
        ConfigError: as :func:`select_attn_backend`; ``attn_backend_unavailable`` if the model class cannot
            switch its attention implementation (it does not use ``AttentionInterface``).
    """
    target = unwrap_model(model)
    if device is None:
        first = next(target.parameters()).device
        device = torch.device("cuda") if first.type == "cpu" and torch.cuda.is_available() else first
    resolved = select_attn_backend(backend, device)
    register_pair_varlen()
    if target.config._attn_implementation != PAIR_VARLEN:
        target.set_attn_implementation(PAIR_VARLEN)
    if target.config._attn_implementation != PAIR_VARLEN:
        raise ConfigError(
            "attn_backend_unavailable",
            f"{type(target).__name__} does not dispatch attention through transformers' AttentionInterface, "
            "so packed (varlen) attention cannot be enabled for it",
        )
    for module in target.modules():
        setattr(module, _BACKEND_ATTR, backend)
    return resolved


def share_prompt_unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run the shared-prompt layout, or None when it can.

    Needs the ``pair_varlen`` attention (the only one that reads the gathered key segments), a model class that
    hands the forward's keywords to its attention function (transformers' ``_supports_attention_backend``: the
    ``pair_kv_index`` keyword must reach every layer) and no sliding-window layer (a window over ``[p r]`` keys
    would need the key offsets of the unshared sequence).
    """
    target = unwrap_model(model)
    config = target.config
    if config._attn_implementation != PAIR_VARLEN:
        return f"its attention is {config._attn_implementation!r}, not {PAIR_VARLEN!r}"
    if not getattr(target, "_supports_attention_backend", False):
        return f"{type(target).__name__} does not pass the forward's keywords to its attention function"
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        sliding = any("sliding" in str(kind) for kind in layer_types)
    else:
        sliding = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    if sliding:
        return f"{type(target).__name__} has sliding-window attention layers (sliding_window={config.sliding_window})"
    return None


def resolve_share_prompt(requested: bool | None, model: torch.nn.Module) -> tuple[bool, str | None]:
    """The layout a run uses: ``(share, why_not)``; ``requested`` is ``PairDPOConfig.share_prompt``.

    Raises:
        ConfigError: ``share_prompt_unsupported`` when ``requested`` is True and the model cannot run it.
    """
    if requested is False:
        return False, "share_prompt=False"
    reason = share_prompt_unsupported_reason(model)
    if reason is not None and requested:
        raise ConfigError(
            "share_prompt_unsupported",
            f"share_prompt=True, but {reason}: set share_prompt=None (the unshared layout where unsupported) or False.",
        )
    return reason is None, reason


def packed_forward_kwargs(batch: PackedPairBatch) -> dict[str, Any]:
    """Keyword arguments of a packed forward: ids, positions, varlen boundaries and ``use_cache=False`` (under
    sequence parallelism the ids and positions of this rank's slice, the boundaries of the whole row).

    ``use_cache=False`` is required: with a cache, transformers treats the row as one long causal sequence and
    packed sequences silently attend across their boundaries. A shared-prompt batch also passes its key segments
    (``cu_seq_lens_k`` over the keys gathered by ``pair_kv_index``), which only ``pair_varlen`` reads.
    """
    shared = batch.kv_index is not None
    shard = batch.sequence_shard  # sequence parallelism: this rank's tokens; the boundaries stay the whole row's
    tokens = slice(None) if shard is None else slice(shard.start, shard.end)
    kwargs: dict[str, Any] = {
        "input_ids": batch.input_ids[:, tokens],
        "position_ids": batch.position_ids[:, tokens],
        "cu_seq_lens_q": batch.cu_seqlens,
        "cu_seq_lens_k": batch.cu_seqlens_k if shared else batch.cu_seqlens,
        "max_length_q": batch.max_seqlen,
        "max_length_k": batch.max_seqlen_k if shared else batch.max_seqlen,
        "use_cache": False,
    }
    if shared:
        kwargs[KV_INDEX_KWARG] = batch.kv_index
    return kwargs


def pair_varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention function with transformers' ``AttentionInterface`` signature.

    Args:
        module: The calling attention layer (``is_causal`` is read from it unless passed as a keyword).
        query: ``[B, Hq, T, D]``.
        key: ``[B, Hkv, T, D]`` (``Hq`` a multiple of ``Hkv``: GQA).
        value: ``[B, Hkv, T, D]``.
        attention_mask: Must be None (packed rows carry their boundaries in ``cu_seq_lens_q``).
        dropout: Attention dropout probability (transformers passes 0.0 in eval mode).
        scaling: Softmax scale (default ``D ** -0.5``).
        sliding_window: Window of sliding-window layers (Mistral / Qwen2 / Qwen3): a query attends to the
            ``sliding_window`` most recent keys, itself included.
        softcap: Attention logit soft-capping (flash_attn only).
        **kwargs: ``cu_seq_lens_q`` (int32 ``[S + 1]`` over the ``B * T`` flattened tokens), ``max_length_q``
            (int). Without them every row is one causal sequence. With ``pair_kv_index`` (``[Tk]`` int64, the
            shared-prompt layout) the keys/values are gathered from the row by it and segmented by
            ``cu_seq_lens_k`` / ``max_length_k``; query segment ``s`` attends to key segment ``s``, causal
            bottom-right aligned. Without it the key segments are the query segments.

    Under sequence parallelism (the module carries a
    :class:`~pair_dpo_trainer.modeling.sequence_parallel.SequenceParallel` group) ``T`` is this rank's slice of the
    row: the kernel runs on the whole row for this rank's share of the heads, between two all-to-alls.

    Returns:
        ``(attn_output [B, T, Hq, D], None)``, the layout transformers expects.
    """
    if attention_mask is not None:
        raise ConfigError(
            "attn_feature_unsupported",
            "pair_varlen attention got an attention mask; packed rows pass cu_seq_lens_q/k instead",
        )
    parallel = module_sequence_parallel(module)
    if parallel is not None:  # Ulysses: the whole row for this rank's share of the heads
        query = gather_sequence(query, parallel)
        key = gather_sequence(key, parallel, repeat=parallel.kv_repeat)
        value = gather_sequence(value, parallel, repeat=parallel.kv_repeat)
    batch, heads, length, head_dim = query.shape
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    max_seqlen = kwargs.get("max_length_q")
    if cu_seqlens is None:
        cu_seqlens = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=query.device)
        max_seqlen = length
    key, value = _packed(key), _packed(value)
    kv_index = kwargs.get(KV_INDEX_KWARG)
    cu_seqlens_k, max_seqlen_k = cu_seqlens, max_seqlen
    if kv_index is not None:  # shared-prompt layout: key segments [p c][p r] gathered from the row
        key, value = key.index_select(0, kv_index), value.index_select(0, kv_index)
        cu_seqlens_k, max_seqlen_k = kwargs["cu_seq_lens_k"], kwargs["max_length_k"]
    is_causal = kwargs.get("is_causal")
    requested = getattr(module, _BACKEND_ATTR, "auto")
    backend = _resolve_cached(requested, query.device, query.dtype)
    out = varlen_attention(
        _packed(query),
        key,
        value,
        cu_seqlens,
        _length(max_seqlen),
        backend=backend,
        scale=scaling,
        causal=bool(getattr(module, "is_causal", True) if is_causal is None else is_causal),
        sliding_window=sliding_window,
        dropout=dropout,
        softcap=softcap,
        cu_seqlens_k=None if kv_index is None else cu_seqlens_k,
        max_seqlen_k=None if kv_index is None else _length(max_seqlen_k),
    )
    out = out.view(batch, length, heads, head_dim)
    return (out if parallel is None else scatter_sequence(out, parallel)), None


def _length(value: Any) -> int:
    """A python int (a SymInt stays symbolic)."""
    return value if isinstance(value, (int, torch.SymInt)) else int(value)  # type: ignore[return-value]


def _packed(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, D]`` -> contiguous ``[B * T, H, D]``."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]).contiguous()


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    backend: str,
    scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
) -> torch.Tensor:
    """Attention inside each ``cu_seqlens`` segment of packed tokens.

    Args:
        query: ``[N, Hq, D]`` packed queries.
        key: ``[N, Hkv, D]`` packed keys.
        value: ``[N, Hkv, D]`` packed values.
        cu_seqlens: int32 ``[S + 1]`` segment boundaries, ``cu_seqlens[-1] == N``.
        max_seqlen: Longest segment.
        backend: One of :data:`BACKENDS` (already validated).
        scale: Softmax scale (default ``D ** -0.5``).
        causal: Causal attention inside a segment.
        sliding_window: Attend only to the ``sliding_window`` most recent keys (causal only).
        dropout: Attention dropout probability (not supported by ``torch_varlen``).
        softcap: Attention logit soft-capping (``flash_attn`` only).
        cu_seqlens_k: int32 ``[S + 1]`` key segments when they differ from the query segments (``key`` / ``value``
            are then ``[Nk, Hkv, D]``): query segment ``s`` attends to key segment ``s``, a causal mask aligned
            bottom-right (query ``i`` of ``Lq`` sees keys ``0 .. i + Lk - Lq``). No sliding window with them.
        max_seqlen_k: Longest key segment (with ``cu_seqlens_k``).

    Returns:
        ``[N, Hq, D]`` attention output in the dtype of ``query``.

    Raises:
        ConfigError: ``attn_feature_unsupported`` for a feature the backend cannot honour exactly.
    """
    if sliding_window is not None and not causal:
        raise ConfigError("attn_feature_unsupported", "a bidirectional sliding window is not supported")
    if softcap and backend != "flash_attn":
        raise ConfigError("attn_feature_unsupported", f"attention soft-capping needs flash_attn, not {backend}")
    if cu_seqlens_k is not None and sliding_window is not None:
        raise ConfigError("attn_feature_unsupported", "a shared-prompt row cannot run sliding-window attention")
    left = -1 if sliding_window is None else int(sliding_window) - 1
    cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    max_k = max_seqlen if max_seqlen_k is None else max_seqlen_k
    if backend == "sdpa_segments":
        bounds = cu_seqlens.tolist()
        bounds_k = bounds if cu_seqlens_k is None else cu_seqlens_k.tolist()
        return _sdpa_segments(query, key, value, (bounds, bounds_k), scale, causal, sliding_window, dropout)
    cu_q, cu_k = cu_seqlens.to(torch.int32), cu_k.to(torch.int32)
    if backend == "flash_attn":
        extra = {"softcap": float(softcap)} if softcap else {}
        return _kernel(backend)(
            query, key, value, cu_q, cu_k, max_seqlen, max_k,
            dropout_p=dropout, softmax_scale=scale, causal=causal,
            window_size=(left, 0 if causal else -1), **extra,
        )  # fmt: skip
    if dropout > 0.0:
        raise ConfigError("attn_feature_unsupported", "torch_varlen has no attention dropout; set it to 0")
    varlen_attn = _kernel(backend)
    extra = {"enable_gqa": True} if _GQA_KWARGS[backend] and query.shape[1] != key.shape[1] else {}
    return varlen_attn(
        query, key, value, cu_q, cu_k, max_seqlen, max_k,
        scale=scale, window_size=(left, 0 if causal else -1), **extra,
    )  # fmt: skip


def _window_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """``[L, L]`` bool causal band: query ``i`` sees keys ``i - window < j <= i``."""
    offset = torch.arange(length, device=device)
    delta = offset[:, None] - offset[None, :]
    return (delta >= 0) & (delta < window)


def _sdpa_segments(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: tuple[list[int], list[int]],
    scale: float | None,
    causal: bool,
    window: int | None,
    dropout: float,
) -> torch.Tensor:
    """SDPA once per segment: exact, no cross-segment ``[N, N]`` mask. Shapes as :func:`varlen_attention`;
    ``bounds`` are the query and the key segment boundaries (the same list in the unshared layout)."""
    bounds_q, bounds_k = bounds
    if bounds_q[0] != 0 or bounds_q[-1] != query.shape[0] or bounds_k[-1] != key.shape[0]:
        raise ValueError(f"cu_seqlens must span all {query.shape[0]} tokens, got bounds {bounds_q[0]}..{bounds_q[-1]}")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    outputs = []
    for (start, end), (start_k, end_k) in zip(_spans(bounds_q), _spans(bounds_k), strict=True):
        if end == start:
            continue
        mask = _segment_mask(end - start, end_k - start_k, causal, window, query.device)
        q = query[start:end].transpose(0, 1).unsqueeze(0)
        k, v = (x[start_k:end_k].transpose(0, 1).unsqueeze(0) for x in (key, value))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal and mask is None, scale=scale
        )
        outputs.append(out[0].transpose(0, 1))
    return torch.cat(outputs, dim=0)


def _spans(bounds: list[int]) -> list[tuple[int, int]]:
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _segment_mask(
    length_q: int, length_k: int, causal: bool, window: int | None, device: torch.device
) -> torch.Tensor | None:
    """The explicit mask of one segment pair, or None where SDPA's own ``is_causal`` (top-left) is exact."""
    if length_q != length_k:
        if not causal:
            return None
        return torch.ones(length_q, length_k, dtype=torch.bool, device=device).tril(length_k - length_q)
    if window is not None and length_q > window:
        return _window_mask(length_q, window, device)
    return None
