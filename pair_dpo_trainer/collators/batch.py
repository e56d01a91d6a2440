"""The batch contract: :class:`PackedPairBatch`, the sequence order of a pair (chosen, then rejected) and the feature
keys that fill its optional fields. Imports only torch and the standard library, so every stage that reads or
writes a batch depends on this module, not on the collator.

Who writes each field:

- the packing collator (``collators/packed.py``, ``PackedPairCollator``): every required field, ``completion_targets``
  / ``completion_sequences``, ``num_pad_tokens`` (``pad_to_multiple_of`` / ``pad_to_length``), ``prompt_positions`` /
  ``prompt_targets`` (``score_chosen_prompts``, ORPO), and in the shared-prompt layout (``share_prompt``) the key
  gather ``kv_index``, ``cu_seqlens_k``, ``max_seqlen_k`` and ``num_shared_prompt_tokens``; under sequence
  parallelism (``sequence_shard=(rank, size)``) this rank's ``sequence_shard``;
- ``pair_weights``: the collator, from the ``pair_weight`` feature key that the evaluation plan's dataset view adds
  (``samplers/evaluation.py``, ``WeightedPairs``: weight-0 fillers);
- ``ref_logps``: the collator, from the :data:`REF_LOGPS_KEYS` feature keys that the reference precompute stage's
  dataset view adds (``reference/precompute.py``);
- ``token_weights``: LD-DPO's ``with_length_desensitization`` (``losses/length_weights.py``), called by the trainer on
  the device batch and by the precompute pass;
- ``step_context``: the objective at run time (``training/objective.py``, ``ObjectiveRuntime.attach_step_contexts``,
  contexts built by ``training/step_context.py``), through :meth:`PackedPairBatch.with_step_context`; the step
  collation (``collators/step.py``, ``StepBatch``) groups finished batches and writes no field.

Details: collators/README.md, "Module notes", ``batch.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch

IGNORE_INDEX = -100
"""Label value of positions that are not scored."""

CHOSEN = 0
"""Position of a pair's chosen sequence among its two (sequence ``2*i + CHOSEN``)."""

REJECTED = 1
"""Position of a pair's rejected sequence among its two (sequence ``2*i + REJECTED``)."""


def pair_rows(values: torch.Tensor) -> torch.Tensor:
    """Per-sequence values ``[2n, ...]`` in the collators' order -> ``[n, 2, ...]`` (column ``CHOSEN`` /
    ``REJECTED``), a view where the layout allows one.

    Raises:
        ValueError: ``values`` is not ``[2n, ...]``.
    """
    if values.ndim == 0 or values.shape[0] % 2:
        raise ValueError(f"expected [2n, ...] per-sequence values, got shape {tuple(values.shape)}")
    return values.unflatten(0, (-1, 2))


def split_pairs(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence values ``[2n, ...]`` -> ``(chosen [n, ...], rejected [n, ...])`` (views, device ops only).

    Example:
        >>> split_pairs(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        (tensor([1., 3.]), tensor([2., 4.]))

    Raises:
        ValueError: ``values`` is not ``[2n, ...]``.
    """
    rows = pair_rows(values)
    return rows[:, CHOSEN], rows[:, REJECTED]


def _move(value: Any, fn: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    return value._map(fn) if isinstance(value, _TensorDataclass) else value


class _TensorDataclass:
    """Mixin: ``.to()`` and ``.pin_memory()`` for a dataclass whose tensor fields (nested ones too) move together."""

    def _map(self, fn: Any) -> Any:
        changes = {f.name: _move(getattr(self, f.name), fn) for f in fields(self)}  # type: ignore[arg-type]
        return replace(self, **changes)  # type: ignore[type-var]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Any:
        """Return a copy with every tensor field on ``device`` (python ints stay as they are).

        Args:
            device: Target device.
            non_blocking: Passed to ``Tensor.to``; asynchronous from pinned memory.
        """
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Any:
        """Return a copy with every tensor in pinned memory (``DataLoader(pin_memory=True)`` calls it)."""
        return self._map(torch.Tensor.pin_memory)


@dataclass(frozen=True)
class SequenceShard(_TensorDataclass):
    """One rank's slice of a packed row under sequence parallelism (``sequence_parallel_size``).

    The batch keeps the whole row (every rank of the group holds the same one); the shard says which tokens this rank
    computes and which scored positions fall among them.

    Attributes:
        rank: This rank's index in its sequence-parallel group.
        size: Ranks in the group (the row's length ``T`` is a multiple of it).
        start: First token of the slice (``rank * T / size``).
        end: One past its last token.
        completion_index: ``[N_r]`` int64 indices into ``completion_positions`` (and its targets, sequences and
            token weights) of the scored positions in ``[start, end)``.
        prompt_index: ``[M_r]`` int64 indices into ``prompt_positions`` in the slice, or None.
        real_tokens: Tokens of the pairs' sequences in the slice (the pad segment excluded).
    """

    rank: int
    size: int
    start: int
    end: int
    completion_index: torch.Tensor
    prompt_index: torch.Tensor | None
    real_tokens: int


@dataclass(frozen=True)
class PackedPairBatch(_TensorDataclass):
    """One micro-batch of ``n`` pairs packed into one row of ``T`` tokens (``2n`` sequences).

    Attributes:
        input_ids: ``[1, T]`` int64 token ids (padding only in the optional trailing pad segment).
        position_ids: ``[1, T]`` int64, restarting at 0 for every sequence (and for the pad segment); in the
            shared-prompt layout a rejected completion continues from its prompt's end, as the chosen one does.
        cu_seqlens: ``[2n + 1]`` int32 cumulative sequence boundaries (query segments ``[p c]``, ``[r]`` in the
            shared-prompt layout), ``cu_seqlens[0] == 0`` and
            ``cu_seqlens[-1] == T``; ``[2n + 2]`` when a pad segment was added (``pad_to_multiple_of`` /
            ``pad_to_length``).
        max_seqlen: Longest segment (sequence or pad segment) in tokens, a python int.
        labels: ``[1, T]`` int64 shifted targets: the next token when it is a completion token of the same
            sequence, else ``-100``. Row-local: in the shared-prompt layout the rejected completion's first token
            (predicted at the prompt's last row, whose label is the chosen one's) is only in ``completion_targets``.
        completion_mask: ``[1, T]`` bool, ``labels != -100``.
        sequence_index: ``[1, T]`` int64, the sequence each token belongs to (``2n`` for pad tokens).
        num_pairs: ``n``.
        completion_positions: ``[N]`` int64 flat positions ``j`` where ``completion_mask[0, j]`` is true, in
            order (``N`` scored tokens); lets the log-prob code gather scored rows without a host sync.
        pair_weights: ``[n]`` float32 metric weight per pair when the features carry ``pair_weight`` (evaluation
            fills short ranks with weight-0 duplicates, see :mod:`pair_dpo_trainer.samplers.evaluation`), else
            None (every pair weighs 1).
        ref_logps: ``[2n]`` float32 precomputed reference log-probs in sequence order (chosen, rejected, ...) when
            the features carry ``ref_chosen_logps`` / ``ref_rejected_logps`` (``precompute_ref_log_probs``), else None.
            Kept float32 on the way to the device (the trainer moves the batch with ``.to(device)`` only).
        token_weights: ``[N]`` float64 per-scored-token weights of the summed log-probs (LD-DPO, set by the trainer
            with :func:`pair_dpo_trainer.losses.length_weights.with_length_desensitization`), else None (all 1).
        step_context: The :class:`~pair_dpo_trainer.losses.StepContext` the trainer attaches before an optimizer
            step (quantities of the whole step for step-level objectives), else None.
        num_pad_tokens: Tokens of the trailing pad segment (0 without one).
        prompt_positions: ``[M]`` int64 flat positions whose next token is a prompt token of a chosen sequence (all
            but the first prompt token), when the collator scores chosen prompts (ORPO's NLL), else None.
        prompt_targets: ``[M]`` int64 the prompt token each of ``prompt_positions`` predicts, else None.
        completion_targets: ``[N]`` int64 the token each of ``completion_positions`` predicts, else None (read from
            ``labels``). The collator always sets it; in the shared-prompt layout it is the only complete list, since
            the prompt's last position predicts the first token of both completions.
        completion_sequences: ``[N]`` int64 the sequence each scored token belongs to, else None (read from
            ``sequence_index``).
        kv_index: Shared-prompt layout only: ``[Tk]`` int64 row positions gathered into the keys/values of the
            attention, ``[p c][p r]`` per pair (then the pad segment), else None (keys are the row itself).
        cu_seqlens_k: Shared-prompt layout only: ``[S + 1]`` int32 key-segment boundaries over the gathered keys
            (``cu_seqlens`` holds the query segments ``[p c]``, ``[r]``); a causal mask between a query segment and
            its key segment is bottom-right aligned (the last query sees the last key). Else None (``cu_seqlens``).
        max_seqlen_k: Longest key segment (shared-prompt layout), else None (``max_seqlen``).
        num_shared_prompt_tokens: Prompt tokens stored once instead of twice (0 in the unshared layout): the tokens
            TRL's layout would compute are ``num_real_tokens + num_shared_prompt_tokens``.
        sequence_shard: Under sequence parallelism, the slice of the row this rank computes
            (:class:`SequenceShard`), else None.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    labels: torch.Tensor
    completion_mask: torch.Tensor
    sequence_index: torch.Tensor
    num_pairs: int
    completion_positions: torch.Tensor
    pair_weights: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    token_weights: torch.Tensor | None = None
    step_context: Any = None
    num_pad_tokens: int = 0
    prompt_positions: torch.Tensor | None = None
    prompt_targets: torch.Tensor | None = None
    completion_targets: torch.Tensor | None = None
    completion_sequences: torch.Tensor | None = None
    kv_index: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_k: int | None = None
    num_shared_prompt_tokens: int = 0
    sequence_shard: SequenceShard | None = None

    @property
    def shares_prompt(self) -> bool:
        """True in the shared-prompt layout (``[p c r]`` per pair)."""
        return self.kv_index is not None

    @property
    def num_unshared_tokens(self) -> int:
        """Tokens of the pairs with every prompt counted twice, as TRL's layout computes them (no pad segment); this
        rank's share under sequence parallelism (the saved prompt tokens counted by the group's first rank)."""
        first = self.sequence_shard is None or self.sequence_shard.rank == 0
        return self.num_real_tokens + (self.num_shared_prompt_tokens if first else 0)

    @property
    def counts_pairs(self) -> bool:
        """Whether this rank counts the batch's pairs in throughput metrics (one rank per sequence-parallel group)."""
        return self.sequence_shard is None or self.sequence_shard.rank == 0

    def scored_targets(self) -> torch.Tensor:
        """``[N]`` the target token of every ``completion_positions`` entry (device ops only)."""
        if self.completion_targets is not None:
            return self.completion_targets
        return self.labels.reshape(-1).index_select(0, self.completion_positions)

    def scored_sequences(self) -> torch.Tensor:
        """``[N]`` the sequence of every ``completion_positions`` entry (device ops only)."""
        if self.completion_sequences is not None:
            return self.completion_sequences
        return self.sequence_index.reshape(-1).index_select(0, self.completion_positions)

    @property
    def num_sequences(self) -> int:
        """Number of real sequences, ``2 * num_pairs`` (the pad segment is not counted)."""
        return 2 * self.num_pairs

    @property
    def num_tokens(self) -> int:
        """Row length ``T`` including any pad segment."""
        return int(self.input_ids.shape[1])

    @property
    def num_row_tokens(self) -> int:
        """Tokens of the pairs' sequences in the whole row (``T`` without the pad segment), whichever ranks compute
        them."""
        return self.num_tokens - self.num_pad_tokens

    @property
    def num_row_unshared_tokens(self) -> int:
        """:attr:`num_row_tokens` with every prompt counted twice, as TRL's layout computes them."""
        return self.num_row_tokens + self.num_shared_prompt_tokens

    @property
    def num_real_tokens(self) -> int:
        """Tokens of the pairs' sequences this rank computes (what metrics and FLOPs count): ``T`` without the pad
        segment, or the slice's share of them under sequence parallelism."""
        if self.sequence_shard is not None:
            return self.sequence_shard.real_tokens
        return self.num_row_tokens

    def with_step_context(self, context: Any) -> PackedPairBatch:
        """A copy carrying ``context`` (see ``step_context``)."""
        return replace(self, step_context=context)


REF_LOGPS_KEYS = ("ref_chosen_logps", "ref_rejected_logps")
"""Feature keys of precomputed reference log-probs (see :mod:`pair_dpo_trainer.reference.precompute`)."""
