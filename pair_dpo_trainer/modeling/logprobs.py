"""Per-sequence log-probabilities of completions, for packed rows (chunked) and padded rows (reference).

Details: modeling/README.md, "Module notes", ``logprobs.py``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, cast

import torch

from pair_dpo_trainer.collators.batch import PackedPairBatch
from pair_dpo_trainer.collators.padded import PaddedPairBatch
from pair_dpo_trainer.errors import ConfigError
from pair_dpo_trainer.modeling.attention import PAIR_VARLEN, packed_forward_kwargs
from pair_dpo_trainer.modeling.chunked_head import (
    DEFAULT_CHUNK_SIZE,
    TOKEN_STATS,
    _acc_dtype,
    chunked_token_logps,
    module_chunked_token_logps,
)
from pair_dpo_trainer.modeling.sequence_parallel import SequenceParallel, model_sequence_parallel, sum_over_group
from pair_dpo_trainer.modeling.wrappers import forward_replaced, is_fsdp_managed, unwrap_model

_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


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
    shard = batch.sequence_shard
    index = None if shard is None else shard.completion_index
    positions, targets, sequences = _in_shard(
        batch, index, batch.completion_positions, batch.scored_targets(), batch.scored_sequences()
    )
    scored = int(positions.shape[0])  # host-known shape: no sync
    extra = batch.prompt_positions if prompts else None
    if extra is not None:
        index = None if shard is None else shard.prompt_index
        prompt_sequences = batch.sequence_index.reshape(-1).index_select(0, extra)
        extra, prompt_targets, prompt_sequences = _in_shard(
            batch, index, extra, cast(torch.Tensor, batch.prompt_targets), prompt_sequences
        )
        positions = torch.cat([positions, extra])
        targets = torch.cat([targets, prompt_targets])
        sequences = torch.cat([sequences, prompt_sequences])
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


def _in_shard(
    batch: PackedPairBatch, index: torch.Tensor | None, positions: torch.Tensor, *columns: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Scored ``positions`` of the row and their aligned ``columns`` (targets, sequences): all of them, or under
    sequence parallelism the entries ``index`` of this rank's slice, positions relative to the slice."""
    shard = batch.sequence_shard
    if shard is None or index is None:
        return (positions, *columns)
    return (positions.index_select(0, index) - shard.start, *(c.index_select(0, index) for c in columns))


def _local_token_weights(batch: PackedPairBatch) -> torch.Tensor | None:
    """``batch.token_weights`` of the scored tokens this rank computes (see :func:`_in_shard`)."""
    weights, shard = batch.token_weights, batch.sequence_shard
    if weights is None or shard is None:
        return weights
    return weights.index_select(0, shard.completion_index)


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
    weights = _local_token_weights(batch)
    if weights is not None:
        token_logps = token_logps * weights.to(token_logps.dtype)
    sums = _sequence_sums(token_logps, scored.sequences, batch.num_sequences)
    return sum_over_group(sums, model_sequence_parallel(model))


def packed_policy_logps(
    model: torch.nn.Module, batch: PackedPairBatch, *, chunk_size: int = DEFAULT_CHUNK_SIZE, with_stats: bool = True
) -> SequenceLogps:
    """The policy's per-sequence log-probs and, with ``with_stats``, the per-token statistics summed per sequence
    (computed inside the chunked head: no ``[T, V]`` tensor, no host sync); with the chosen prompts' log-probs when
    the batch lists them (``prompt_positions``). Shapes and errors as :func:`packed_sequence_logps`."""
    scored = _scored_token_logps(model, batch, chunk_size, with_stats=with_stats, prompts=True)
    sums = _local_sums(scored.token_logps, scored.stats, scored.sequences, batch)
    if scored.prompt_logps is not None and scored.prompt_sequences is not None:
        n = batch.num_sequences
        sums["prompt_logps"] = _sequence_sums(scored.prompt_logps, scored.prompt_sequences, n)
        sums["prompt_token_counts"] = _sequence_sums(torch.ones_like(scored.prompt_logps), scored.prompt_sequences, n)
    return _sequence_logps(_summed_over_group(sums, model_sequence_parallel(model)))


def sequence_logps_from_tokens(
    token_logps: torch.Tensor,
    stats: torch.Tensor | None,
    sequences: torch.Tensor,
    batch: PackedPairBatch,
    *,
    parallel: SequenceParallel | None = None,
) -> SequenceLogps:
    """Per-sequence sums of the scored tokens' log-probs (plain, and LD-weighted by ``batch.token_weights``) and of
    their :data:`TOKEN_STATS` (``[N]``, ``[N, 4] | None``, ``sequences [N]`` in ``completion_positions`` order, or
    this rank's share of them under sequence parallelism: the sums are then taken over ``parallel``'s group)."""
    return _sequence_logps(_summed_over_group(_local_sums(token_logps, stats, sequences, batch), parallel))


def _local_sums(
    token_logps: torch.Tensor, stats: torch.Tensor | None, sequences: torch.Tensor, batch: PackedPairBatch
) -> dict[str, torch.Tensor]:
    """This rank's per-sequence sums, by :class:`SequenceLogps` field: ``nll_logps`` (plain), ``logps`` (LD-weighted,
    only with token weights) and ``token_stats`` (with statistics)."""
    n = batch.num_sequences
    sums = {"nll_logps": _sequence_sums(token_logps, sequences, n)}
    weights = _local_token_weights(batch)
    if weights is not None:
        sums["logps"] = _sequence_sums(token_logps * weights.to(token_logps.dtype), sequences, n)
    if stats is not None:
        stats = stats.clone()
        stats[:, 3] = token_logps.detach() - stats[:, 3]  # WPO: log p_t - log sum_v p_v^2
        sums["token_stats"] = _sequence_sums(stats, sequences, n)
    return sums


def _summed_over_group(sums: dict[str, torch.Tensor], parallel: SequenceParallel | None) -> dict[str, torch.Tensor]:
    """``sums`` added over a sequence-parallel group in ONE all-reduce (a pass's sums travel together), unchanged
    without a group."""
    if parallel is None:
        return sums
    values = list(sums.values())
    dtype = functools.reduce(torch.promote_types, (value.dtype for value in values))  # lossless both ways
    flat = sum_over_group(torch.cat([value.reshape(-1).to(dtype) for value in values]), parallel)
    pieces = flat.split([value.numel() for value in values])
    return {name: piece.view_as(value).to(value.dtype) for name, value, piece in zip(sums, values, pieces, strict=True)}


def _sequence_logps(sums: dict[str, torch.Tensor]) -> SequenceLogps:
    """The :class:`SequenceLogps` of a pass's sums (``logps`` is the plain sum itself without token weights)."""
    plain = sums["nll_logps"]
    return SequenceLogps(
        logps=sums.get("logps", plain),
        nll_logps=plain,
        token_stats=sums.get("token_stats"),
        prompt_logps=sums.get("prompt_logps"),
        prompt_token_counts=sums.get("prompt_token_counts"),
    )


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
    "SequenceLogps",
    "check_supported_head",
    "in_forward_token_logps",
    "packed_hidden_states",
    "packed_policy_logps",
    "packed_sequence_logps",
    "padded_sequence_logps",
    "sequence_logps_from_tokens",
]
