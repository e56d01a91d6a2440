"""Packing collator: one micro-batch of preference pairs -> one padding-free row.

The row holds every pair's two sequences back to back, chosen first::

Details: collators/README.md, "Module notes", ``packed.py``.
"""

from __future__ import annotations

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
    return fn(value) if isinstance(value, torch.Tensor) else value


class _TensorDataclass:
    """Mixin: ``.to()`` and ``.pin_memory()`` for a dataclass whose tensor fields move together."""

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Any:
        """Return a copy with every tensor field on ``device`` (python ints stay as they are).

        Args:
            device: Target device.
            non_blocking: Passed to ``Tensor.to``; asynchronous from pinned memory.
        """
        changes = {
            f.name: _move(getattr(self, f.name), lambda t: t.to(device, non_blocking=non_blocking))
            for f in fields(self)  # type: ignore[arg-type]
        }
        return replace(self, **changes)  # type: ignore[type-var]

    def pin_memory(self) -> Any:
        """Return a copy with every tensor in pinned memory (``DataLoader(pin_memory=True)`` calls it)."""
        changes = {f.name: _move(getattr(self, f.name), torch.Tensor.pin_memory) for f in fields(self)}  # type: ignore[arg-type]
        return replace(self, **changes)  # type: ignore[type-var]


@dataclass(frozen=True)
class PackedPairBatch(_TensorDataclass):
    """One micro-batch of ``n`` pairs packed into one row of ``T`` tokens (``2n`` sequences).

    Attributes:
        input_ids: ``[1, T]`` int64 token ids (padding only in the optional trailing pad segment).
        position_ids: ``[1, T]`` int64, restarting at 0 for every sequence (and for the pad segment).
        cu_seqlens: ``[2n + 1]`` int32 cumulative sequence boundaries, ``cu_seqlens[0] == 0`` and
            ``cu_seqlens[-1] == T``; ``[2n + 2]`` when a pad segment was added (``pad_to_multiple_of`` /
            ``pad_to_length``).
        max_seqlen: Longest segment (sequence or pad segment) in tokens, a python int.
        labels: ``[1, T]`` int64 shifted targets: the next token when it is a completion token of the same
            sequence, else ``-100``.
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
        """Tokens of the pairs' sequences: ``T`` without the pad segment (what metrics and FLOPs count)."""
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
    """

    def __init__(
        self,
        pad_to_multiple_of: int | None = None,
        pad_token_id: int = 0,
        pad_to_length: int | None = None,
        score_chosen_prompts: bool = False,
    ) -> None:
        for name, value in (("pad_to_multiple_of", pad_to_multiple_of), ("pad_to_length", pad_to_length)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive int or None, got {value}")
        if pad_to_multiple_of is not None and pad_to_length is not None:
            raise ValueError("give at most one of pad_to_multiple_of and pad_to_length")
        self.pad_to_multiple_of = pad_to_multiple_of
        self.pad_to_length = pad_to_length
        self.pad_token_id = int(pad_token_id)
        self.score_chosen_prompts = score_chosen_prompts

    def __call__(self, features: Sequence[Mapping[str, Sequence[int]]]) -> PackedPairBatch:
        """Pack ``features`` (``n`` pairs) into one row; see the class docstring for the layout."""
        if len(features) == 0:
            raise ValueError("PackedPairCollator got an empty micro-batch")
        ids: list[int] = []
        positions: list[int] = []
        labels: list[int] = []
        seq_index: list[int] = []
        prompt_positions: list[int] = []
        cu = [0]
        for row, feature in enumerate(features):
            chosen, rejected, prompt_length = pair_sequences(feature, row)
            prompt_positions.extend(range(len(ids), len(ids) + prompt_length - 1))  # predict prompt tokens 1..P-1
            for seq in (chosen, rejected):
                ids.extend(seq)
                positions.extend(range(len(seq)))
                labels.extend(sequence_labels(seq, prompt_length))
                seq_index.extend([len(cu) - 1] * len(seq))
                cu.append(len(ids))
        pad = self._pad_length(len(ids))
        if pad:
            ids.extend([self.pad_token_id] * pad)
            positions.extend(range(pad))
            labels.extend([IGNORE_INDEX] * pad)
            seq_index.extend([len(cu) - 1] * pad)
            cu.append(len(ids))
        n = len(features)
        label_tensor = torch.tensor([labels], dtype=torch.int64)
        mask = label_tensor != IGNORE_INDEX
        prompts = torch.tensor(prompt_positions, dtype=torch.int64) if self.score_chosen_prompts else None
        input_ids = torch.tensor([ids], dtype=torch.int64)
        return PackedPairBatch(
            input_ids=input_ids,
            position_ids=torch.tensor([positions], dtype=torch.int64),
            cu_seqlens=torch.tensor(cu, dtype=torch.int32),
            max_seqlen=max(b - a for a, b in zip(cu[:-1], cu[1:], strict=True)),
            labels=label_tensor,
            completion_mask=mask,
            sequence_index=torch.tensor([seq_index], dtype=torch.int64),
            num_pairs=n,
            completion_positions=mask[0].nonzero().flatten(),
            pair_weights=_pair_weights(features),
            ref_logps=_ref_logps(features),
            num_pad_tokens=pad,
            prompt_positions=prompts,
            prompt_targets=None if prompts is None else input_ids[0].index_select(0, prompts + 1),
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
