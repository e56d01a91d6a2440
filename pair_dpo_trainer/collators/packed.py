"""Packing collator: one micro-batch of preference pairs -> one padding-free row.

The row holds every pair's two sequences back to back, chosen first (``[p c][p r]``), or, with ``share_prompt``,
the prompt once (``[p c r]``: the shared-prompt layout, whose rejected tokens attend to the prompt and to themselves
only, through key segments gathered by ``kv_index``)::

Details: collators/README.md, "Module notes", ``packed.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from pair_dpo_trainer.data.tokenize import FEATURE_COLUMNS
from pair_dpo_trainer.errors import ConfigError, PreferenceRowError

IGNORE_INDEX = -100
"""Label value of positions that are not scored."""

PAIR_COLUMNS = FEATURE_COLUMNS
"""The tokenised dataset columns a collator reads from each feature."""

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
    computes and which scored positions fall among them. Written by the collator, on the host.

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


def _in_slice(positions: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Indices of ``positions`` in ``[start, end)`` (host tensors)."""
    return ((positions >= start) & (positions < end)).nonzero().reshape(-1)


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
            with :func:`pair_dpo_trainer.modeling.logprobs.with_length_desensitization`), else None (all 1).
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
    def num_real_tokens(self) -> int:
        """Tokens of the pairs' sequences this rank computes (what metrics and FLOPs count): ``T`` without the pad
        segment, or the slice's share of them under sequence parallelism."""
        if self.sequence_shard is not None:
            return self.sequence_shard.real_tokens
        return self.num_tokens - self.num_pad_tokens

    def with_step_context(self, context: Any) -> PackedPairBatch:
        """A copy carrying ``context`` (see ``step_context``)."""
        return replace(self, step_context=context)


def pair_sequences(feature: Mapping[str, Sequence[int]], row: int) -> tuple[list[int], list[int], int]:
    """Return ``(prompt + chosen, prompt + rejected, prompt_length)`` for one feature, validated.

    Args:
        feature: A mapping with the three ``*_input_ids`` columns (lists of int).
        row: Position of the feature in the micro-batch (for error messages).

    Raises:
        PreferenceRowError: ``empty_completion`` when a completion would contribute no label token (an empty
            completion, or a one-token completion after an empty prompt).
    """
    missing = [c for c in PAIR_COLUMNS if c not in feature]
    if missing:
        raise KeyError(f"feature {row} lacks the column(s) {missing}; the collators need {list(PAIR_COLUMNS)}")
    prompt = [int(t) for t in feature["prompt_input_ids"]]
    chosen = [int(t) for t in feature["chosen_input_ids"]]
    rejected = [int(t) for t in feature["rejected_input_ids"]]
    for name, completion in (("chosen", chosen), ("rejected", rejected)):
        scored = len(completion) if prompt else len(completion) - 1
        if scored <= 0:
            raise PreferenceRowError(
                "empty_completion",
                f"feature {row} of the micro-batch: the {name} completion ({len(completion)} tokens after a "
                f"{len(prompt)}-token prompt) contributes no label token; drop the row or check truncation "
                "(max_length / max_prompt_length)",
            )
    return prompt + chosen, prompt + rejected, len(prompt)


def _pair_weights(features: Sequence[Mapping[str, Any]]) -> torch.Tensor | None:
    """``[n]`` float32 weights from the optional ``pair_weight`` feature key, or None when no feature has one."""
    if not any("pair_weight" in feature for feature in features):
        return None
    return torch.tensor([float(feature.get("pair_weight", 1.0)) for feature in features], dtype=torch.float32)


REF_LOGPS_KEYS = ("ref_chosen_logps", "ref_rejected_logps")
"""Feature keys of precomputed reference log-probs (see :mod:`pair_dpo_trainer.reference.precompute`)."""


def _ref_logps(features: Sequence[Mapping[str, Any]]) -> torch.Tensor | None:
    """``[2n]`` float32 precomputed reference log-probs (chosen, rejected per pair), or None when no feature has them.

    Raises:
        ConfigError: ``ref_logps_missing`` when only some features of the micro-batch carry them.
    """
    present = [all(key in feature for key in REF_LOGPS_KEYS) for feature in features]
    if not any(present):
        return None
    if not all(present):
        raise ConfigError(
            "ref_logps_missing",
            f"feature {present.index(False)} of the micro-batch has no precomputed reference log-probs while others "
            f"have them ({list(REF_LOGPS_KEYS)}): every pair of a run with precompute_ref_log_probs needs both.",
        )
    values = [float(feature[key]) for feature in features for key in REF_LOGPS_KEYS]
    return torch.tensor(values, dtype=torch.float32)


def sequence_labels(ids: Sequence[int], prompt_length: int) -> list[int]:
    """Shifted labels of one sequence: ``ids[j + 1]`` if position ``j + 1`` is a completion token, else -100.

    Example:
        ``sequence_labels([5, 6, 7, 2], prompt_length=2) == [-100, 7, 2, -100]``.
    """
    first = max(prompt_length - 1, 0)
    labels = [IGNORE_INDEX] * len(ids)
    labels[first : len(ids) - 1] = ids[first + 1 :]
    return labels


class _Row:
    """The host lists of one packed row under construction (see :class:`PackedPairCollator`)."""

    def __init__(self, share_prompt: bool) -> None:
        self.share_prompt = share_prompt
        self.ids: list[int] = []
        self.positions: list[int] = []
        self.labels: list[int] = []
        self.seq_index: list[int] = []
        self.cu = [0]
        self.kv_index: list[int] = []
        self.cu_k = [0]
        self.scored: tuple[list[int], list[int], list[int]] = ([], [], [])
        self.prompt_positions: list[int] = []
        self.shared_tokens = 0

    def add_pair(self, prompt: list[int], chosen: list[int], rejected: list[int]) -> None:
        """Append one pair: ``[p c][p r]``, or ``[p c r]`` with ``share_prompt``; score both completions."""
        start, plen, chosen_seq = len(self.ids), len(prompt), len(self.cu) - 1
        self.prompt_positions.extend(range(start, start + plen - 1))  # predict prompt tokens 1..P-1
        chosen_rows = list(range(start, start + plen + len(chosen)))
        self._append(prompt + chosen, range(plen + len(chosen)), chosen_seq)
        if self.share_prompt:
            rejected_rows = chosen_rows[:plen] + list(range(len(self.ids), len(self.ids) + len(rejected)))
            self._append(rejected, range(plen, plen + len(rejected)), chosen_seq + 1)
            self.kv_index.extend(chosen_rows + rejected_rows)
            self.cu_k.extend([self.cu_k[-1] + len(chosen_rows), self.cu_k[-1] + len(chosen_rows) + len(rejected_rows)])
            self.shared_tokens += plen
        else:
            rejected_rows = list(range(len(self.ids), len(self.ids) + plen + len(rejected)))
            self._append(prompt + rejected, range(plen + len(rejected)), chosen_seq + 1)
        self._score(prompt + chosen, chosen_rows, chosen_seq, plen)
        self._score(prompt + rejected, rejected_rows, chosen_seq + 1, plen)

    def _append(self, tokens: list[int], positions: range, sequence: int) -> None:
        self.ids.extend(tokens)
        self.positions.extend(positions)
        self.labels.extend([IGNORE_INDEX] * len(tokens))
        self.seq_index.extend([sequence] * len(tokens))
        self.cu.append(len(self.ids))

    def _score(self, tokens: list[int], rows: list[int], sequence: int, prompt_length: int) -> None:
        """Score ``tokens[j + 1]`` at row ``rows[j]`` for every completion token (after the prompt's first)."""
        positions, targets, sequences = self.scored
        for j in range(max(prompt_length - 1, 0), len(tokens) - 1):
            positions.append(rows[j])
            targets.append(tokens[j + 1])
            sequences.append(sequence)
            if rows[j + 1] == rows[j] + 1:  # the next token follows in the row: a row-local label
                self.labels[rows[j]] = tokens[j + 1]

    def add_pad(self, pad: int, pad_token_id: int) -> None:
        """Append the trailing pad segment (its own query and key segment)."""
        start = len(self.ids)
        self._append([pad_token_id] * pad, range(pad), len(self.cu) - 1)
        if self.share_prompt:
            self.kv_index.extend(range(start, start + pad))
            self.cu_k.append(self.cu_k[-1] + pad)


class PackedPairCollator:
    """Collate a micro-batch of pairs into one :class:`PackedPairBatch` (no padding unless asked).

    Example:
        One pair, prompt ``[5, 6]``, chosen ``[7, 2]``, rejected ``[8, 9, 2]``::

            batch = PackedPairCollator()([
                {"prompt_input_ids": [5, 6], "chosen_input_ids": [7, 2], "rejected_input_ids": [8, 9, 2]}
            ])
            batch.input_ids        == [[5, 6, 7, 2, 5, 6, 8, 9, 2]]
            batch.position_ids     == [[0, 1, 2, 3, 0, 1, 2, 3, 4]]
            batch.cu_seqlens       == [0, 4, 9]          # int32
            batch.max_seqlen       == 5
            batch.labels           == [[-100, 7, 2, -100, -100, 8, 9, 2, -100]]
            batch.completion_mask  == [[F, T, T, F, F, T, T, T, F]]
            batch.sequence_index   == [[0, 0, 0, 0, 1, 1, 1, 1, 1]]
            batch.num_pairs        == 1
            batch.completion_positions == [1, 2, 5, 6, 7]

        With ``pad_to_multiple_of=4`` the row grows to 12 tokens: a trailing pad segment of 3
        ``pad_token_id`` tokens (positions ``[0, 1, 2]``, labels -100, ``sequence_index`` 2) and
        ``cu_seqlens == [0, 4, 9, 12]``. With ``pad_to_length=16`` it grows to exactly 16 tokens the same way.

        With ``share_prompt=True`` the same pair takes 7 tokens::

            batch.input_ids            == [[5, 6, 7, 2, 8, 9, 2]]
            batch.position_ids         == [[0, 1, 2, 3, 2, 3, 4]]   # rejected continues from the prompt's end
            batch.cu_seqlens           == [0, 4, 7]                 # query segments [p c], [r]
            batch.kv_index             == [0, 1, 2, 3, 0, 1, 4, 5, 6]
            batch.cu_seqlens_k         == [0, 4, 9]                 # key segments [p c], [p r]
            batch.completion_positions == [1, 2, 1, 4, 5]           # position 1 scores 7 (chosen) and 8 (rejected)
            batch.completion_targets   == [7, 2, 8, 9, 2]
            batch.completion_sequences == [0, 0, 1, 1, 1]
            batch.num_shared_prompt_tokens == 2

    Args:
        pad_to_multiple_of: If set, round ``T`` up to a multiple of it by appending one pad segment (its own
            entry in ``cu_seqlens``, so attention kernels see it as a separate, unscored sequence). Fixed
            shapes help kernels and allocator reuse; the default ``None`` adds no padding at all.
        pad_to_length: If set, make every row exactly this long with the same pad segment (``pad_to_budget``:
            the micro-batch token budget, so every row has one shape); a longer micro-batch raises ``ValueError``.
            Not together with ``pad_to_multiple_of``.
        pad_token_id: Token id of the pad segment.
        score_chosen_prompts: Also list the positions that predict the chosen sequences' prompt tokens
            (``prompt_positions`` / ``prompt_targets``): ORPO's NLL covers prompt and completion, as TRL's does.
        share_prompt: Store each prompt once (``[p c r]``, the shared-prompt layout); the attention must honour
            ``kv_index`` / ``cu_seqlens_k`` (``pair_varlen`` does).
        sequence_shard: ``(rank, size)`` under sequence parallelism: the row is padded to a multiple of ``size``
            tokens (with ``pad_to_multiple_of``, to a common multiple) and carries this rank's
            :class:`SequenceShard`; ``pad_to_length`` must then be a multiple of ``size``.
    """

    def __init__(
        self,
        pad_to_multiple_of: int | None = None,
        pad_token_id: int = 0,
        pad_to_length: int | None = None,
        score_chosen_prompts: bool = False,
        share_prompt: bool = False,
        sequence_shard: tuple[int, int] | None = None,
    ) -> None:
        for name, value in (("pad_to_multiple_of", pad_to_multiple_of), ("pad_to_length", pad_to_length)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive int or None, got {value}")
        if pad_to_multiple_of is not None and pad_to_length is not None:
            raise ValueError("give at most one of pad_to_multiple_of and pad_to_length")
        self.sequence_shard = sequence_shard
        if sequence_shard is not None:
            rank, size = sequence_shard
            if not 0 <= rank < size:
                raise ValueError(f"sequence_shard=(rank, size) needs 0 <= rank < size, got {sequence_shard}")
            if pad_to_length is not None and pad_to_length % size:
                raise ValueError(f"pad_to_length={pad_to_length} must be a multiple of the group size {size}")
            if pad_to_length is None:
                pad_to_multiple_of = math.lcm(pad_to_multiple_of or 1, size)
        self.pad_to_multiple_of = pad_to_multiple_of
        self.pad_to_length = pad_to_length
        self.pad_token_id = int(pad_token_id)
        self.score_chosen_prompts = score_chosen_prompts
        self.share_prompt = bool(share_prompt)

    def __call__(self, features: Sequence[Mapping[str, Sequence[int]]]) -> PackedPairBatch:
        """Pack ``features`` (``n`` pairs) into one row; see the class docstring for the layout."""
        if len(features) == 0:
            raise ValueError("PackedPairCollator got an empty micro-batch")
        row = _Row(self.share_prompt)
        for index, feature in enumerate(features):
            chosen, rejected, prompt_length = pair_sequences(feature, index)
            row.add_pair(chosen[:prompt_length], chosen[prompt_length:], rejected[prompt_length:])
        pad = self._pad_length(len(row.ids))
        if pad:
            row.add_pad(pad, self.pad_token_id)
        return self._batch(row, features, pad)

    def _batch(self, row: _Row, features: Sequence[Mapping[str, Any]], pad: int) -> PackedPairBatch:
        label_tensor = torch.tensor([row.labels], dtype=torch.int64)
        prompts = torch.tensor(row.prompt_positions, dtype=torch.int64) if self.score_chosen_prompts else None
        input_ids = torch.tensor([row.ids], dtype=torch.int64)
        positions, targets, sequences = (torch.tensor(values, dtype=torch.int64) for values in row.scored)
        shared = {}
        if self.share_prompt:
            shared = {
                "kv_index": torch.tensor(row.kv_index, dtype=torch.int64),
                "cu_seqlens_k": torch.tensor(row.cu_k, dtype=torch.int32),
                "max_seqlen_k": _longest(row.cu_k),
                "num_shared_prompt_tokens": row.shared_tokens,
            }
        return PackedPairBatch(
            input_ids=input_ids,
            position_ids=torch.tensor([row.positions], dtype=torch.int64),
            cu_seqlens=torch.tensor(row.cu, dtype=torch.int32),
            max_seqlen=_longest(row.cu),
            labels=label_tensor,
            completion_mask=label_tensor != IGNORE_INDEX,
            sequence_index=torch.tensor([row.seq_index], dtype=torch.int64),
            num_pairs=len(features),
            completion_positions=positions,
            pair_weights=_pair_weights(features),
            ref_logps=_ref_logps(features),
            num_pad_tokens=pad,
            prompt_positions=prompts,
            prompt_targets=None if prompts is None else input_ids[0].index_select(0, prompts + 1),
            completion_targets=targets,
            completion_sequences=sequences,
            sequence_shard=self._shard(len(row.ids), pad, positions, prompts),
            **shared,  # type: ignore[arg-type]
        )

    def _shard(
        self, length: int, pad: int, positions: torch.Tensor, prompts: torch.Tensor | None
    ) -> SequenceShard | None:
        """This rank's :class:`SequenceShard` of a row of ``length`` tokens (the last ``pad`` of them padding)."""
        if self.sequence_shard is None:
            return None
        rank, size = self.sequence_shard
        start, end = rank * length // size, (rank + 1) * length // size
        return SequenceShard(
            rank=rank,
            size=size,
            start=start,
            end=end,
            completion_index=_in_slice(positions, start, end),
            prompt_index=None if prompts is None else _in_slice(prompts, start, end),
            real_tokens=max(min(end, length - pad) - start, 0),
        )

    def _pad_length(self, length: int) -> int:
        if self.pad_to_length is not None:
            if length > self.pad_to_length:
                raise ValueError(
                    f"the micro-batch packs {length} tokens, more than pad_to_length={self.pad_to_length} (the "
                    "micro-batch token budget): plan it with the same max_tokens_per_microbatch"
                )
            return self.pad_to_length - length
        if self.pad_to_multiple_of is None:
            return 0
        return -length % self.pad_to_multiple_of


def _longest(bounds: list[int]) -> int:
    """Longest segment of cumulative ``bounds``."""
    return max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
