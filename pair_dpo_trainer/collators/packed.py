"""Packing collator: one micro-batch of preference pairs -> one padding-free row.

The row holds every pair's two sequences back to back, chosen first (``[p c][p r]``), or, with ``share_prompt``,
the prompt once (``[p c r]``: the shared-prompt layout, whose rejected tokens attend to the prompt and to themselves
only, through key segments gathered by ``kv_index``)::

Details: collators/README.md, "Module notes", ``packed.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pair_dpo_trainer.collators.batch import IGNORE_INDEX, REF_LOGPS_KEYS, PackedPairBatch, SequenceShard
from pair_dpo_trainer.data.tokenize import FEATURE_COLUMNS
from pair_dpo_trainer.errors import ConfigError, PreferenceRowError

PAIR_COLUMNS = FEATURE_COLUMNS
"""The tokenised dataset columns a collator reads from each feature."""


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
            tokens (with ``pad_to_multiple_of``, of ``size x pad_to_multiple_of``: each rank's slice is a multiple of
            it) and carries this rank's :class:`SequenceShard`; ``pad_to_length`` must then be a multiple of ``size``.
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
            if pad_to_length is None:  # every rank's slice a multiple of pad_to_multiple_of (float8's 16)
                pad_to_multiple_of = (pad_to_multiple_of or 1) * size
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


def _in_slice(positions: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Indices of ``positions`` in ``[start, end)`` (host tensors)."""
    return ((positions >= start) & (positions < end)).nonzero().reshape(-1)


def _longest(bounds: list[int]) -> int:
    """Longest segment of cumulative ``bounds``."""
    return max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
