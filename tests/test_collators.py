"""Packed and padded pair collators: exact fields, layout invariants, validation."""

from __future__ import annotations

import random

import pytest
import torch

from pair_dpo_trainer.collators import (
    IGNORE_INDEX,
    PackedPairBatch,
    PackedPairCollator,
    PaddedPairBatch,
    PaddedPairCollator,
    split_pairs,
)
from pair_dpo_trainer.collators.step import StepBatch, StepCollator
from pair_dpo_trainer.errors import PreferenceRowError
from tests.dpo_fixtures import random_features

EXAMPLE = [{"prompt_input_ids": [5, 6], "chosen_input_ids": [7, 2], "rejected_input_ids": [8, 9, 2]}]
F, T_ = False, True


def _tensor(values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype)


def _random_features(rng: random.Random, n: int, vocab: int = 50) -> list[dict[str, list[int]]]:
    return random_features(rng, n, vocab=vocab, prompt_len=(1, 9), completion_len=(1, 8))


def test_packed_literal_example() -> None:
    batch = PackedPairCollator()(EXAMPLE)
    assert isinstance(batch, PackedPairBatch)
    assert torch.equal(batch.input_ids, _tensor([[5, 6, 7, 2, 5, 6, 8, 9, 2]]))
    assert torch.equal(batch.position_ids, _tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]]))
    assert torch.equal(batch.cu_seqlens, _tensor([0, 4, 9], torch.int32))
    assert batch.max_seqlen == 5 and isinstance(batch.max_seqlen, int)
    assert torch.equal(batch.labels, _tensor([[-100, 7, 2, -100, -100, 8, 9, 2, -100]]))
    assert torch.equal(batch.completion_mask, _tensor([[F, T_, T_, F, F, T_, T_, T_, F]], torch.bool))
    assert torch.equal(batch.sequence_index, _tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1]]))
    assert [t.tolist() for t in split_pairs(torch.diff(batch.cu_seqlens))] == [[4], [5]]  # chosen, then rejected
    assert batch.num_pairs == 1 and batch.num_sequences == 2 and batch.num_tokens == 9
    assert torch.equal(batch.completion_positions, _tensor([1, 2, 5, 6, 7]))


def test_packed_pad_to_multiple_of_adds_one_unscored_segment() -> None:
    batch = PackedPairCollator(pad_to_multiple_of=4, pad_token_id=0)(EXAMPLE)
    assert torch.equal(batch.input_ids, _tensor([[5, 6, 7, 2, 5, 6, 8, 9, 2, 0, 0, 0]]))
    assert torch.equal(batch.position_ids, _tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2]]))
    assert torch.equal(batch.cu_seqlens, _tensor([0, 4, 9, 12], torch.int32))
    assert torch.equal(batch.labels[0, 9:], _tensor([-100, -100, -100]))
    assert torch.equal(batch.sequence_index[0, 9:], _tensor([2, 2, 2]))
    assert batch.num_sequences == 2
    # Already a multiple: no pad segment at all.
    assert PackedPairCollator(pad_to_multiple_of=9)(EXAMPLE).cu_seqlens.tolist() == [0, 4, 9]


def test_packed_pad_to_length_makes_every_row_one_shape() -> None:
    """``pad_to_budget``: rows of any content come out exactly ``pad_to_length`` long, the extra tokens unscored."""
    collator = PackedPairCollator(pad_to_length=16, pad_token_id=0)
    batch = collator(EXAMPLE)
    assert batch.num_tokens == 16 and batch.cu_seqlens.tolist() == [0, 4, 9, 16]
    assert torch.equal(batch.position_ids[0, 9:], _tensor(list(range(7))))
    assert (batch.labels[0, 9:] == IGNORE_INDEX).all() and torch.equal(
        batch.completion_positions, _tensor([1, 2, 5, 6, 7])
    )
    two = collator(EXAMPLE + [{"prompt_input_ids": [3], "chosen_input_ids": [4, 2], "rejected_input_ids": [2, 4]}])
    assert two.input_ids.shape == batch.input_ids.shape == (1, 16)
    exact = PackedPairCollator(pad_to_length=9)(EXAMPLE)
    assert exact.cu_seqlens.tolist() == [0, 4, 9]  # already the length: no pad segment
    with pytest.raises(ValueError, match="pad_to_length=8"):
        PackedPairCollator(pad_to_length=8)(EXAMPLE)
    with pytest.raises(ValueError, match="at most one"):
        PackedPairCollator(pad_to_length=8, pad_to_multiple_of=4)


def test_step_collator_packs_each_microbatch_and_moves_them_together() -> None:
    step = StepCollator(PackedPairCollator(pad_to_length=12))([EXAMPLE, EXAMPLE])
    assert isinstance(step, StepBatch) and len(step) == 2 and step.num_pairs == 2 and step.num_tokens == 24
    moved = step.to("cpu")
    assert all(isinstance(mb, PackedPairBatch) and mb.num_tokens == 12 for mb in moved.microbatches)
    with pytest.raises(ValueError):
        StepCollator(PackedPairCollator())([])


def test_padded_literal_example() -> None:
    batch = PaddedPairCollator(pad_token_id=0)(EXAMPLE)
    assert isinstance(batch, PaddedPairBatch)
    assert torch.equal(batch.input_ids, _tensor([[5, 6, 7, 2, 0], [5, 6, 8, 9, 2]]))
    assert torch.equal(batch.attention_mask, _tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]))
    assert torch.equal(batch.labels, _tensor([[-100, 7, 2, -100, -100], [-100, 8, 9, 2, -100]]))
    assert torch.equal(batch.completion_mask, _tensor([[F, T_, T_, F, F], [F, T_, T_, T_, F]], torch.bool))
    assert [t.tolist() for t in split_pairs(batch.attention_mask.sum(dim=1))] == [[4], [5]]  # chosen, then rejected
    assert PaddedPairCollator(pad_to_multiple_of=8)(EXAMPLE).input_ids.shape == (2, 8)


@pytest.mark.parametrize("seed", range(5))
def test_packed_layout_invariants(seed: int) -> None:
    rng = random.Random(seed)
    features = _random_features(rng, rng.randint(1, 6))
    batch = PackedPairCollator(pad_token_id=999)(features)
    sequences = [f["prompt_input_ids"] + f[k] for f in features for k in ("chosen_input_ids", "rejected_input_ids")]
    n = len(features)
    # No padding anywhere: the row is exactly the concatenated sequences.
    assert batch.input_ids[0].tolist() == [t for s in sequences for t in s]
    assert 999 not in batch.input_ids.tolist()[0]
    # Both halves of every pair, chosen first.
    chosen, rejected = split_pairs(torch.diff(batch.cu_seqlens))
    assert chosen.tolist() == [len(f["prompt_input_ids"] + f["chosen_input_ids"]) for f in features]
    assert rejected.tolist() == [len(f["prompt_input_ids"] + f["rejected_input_ids"]) for f in features]
    assert batch.num_pairs == n and batch.num_sequences == 2 * n
    # cu_seqlens consistency.
    lengths = torch.diff(batch.cu_seqlens).tolist()
    assert lengths == [len(s) for s in sequences] and batch.cu_seqlens[0] == 0
    assert batch.cu_seqlens[-1] == batch.input_ids.shape[1] and batch.cu_seqlens.dtype == torch.int32
    assert batch.max_seqlen == max(lengths)
    assert batch.sequence_index[0].tolist() == [i for i, n_tok in enumerate(lengths) for _ in range(n_tok)]
    assert batch.position_ids[0].tolist() == [p for n_tok in lengths for p in range(n_tok)]
    # Labels: the next token of the same sequence, completion tokens only, each completion token once.
    labels, ids, seq = batch.labels[0], batch.input_ids[0], batch.sequence_index[0]
    scored = (labels != IGNORE_INDEX).nonzero().flatten()
    assert torch.equal(labels[scored], ids[scored + 1]) and torch.equal(seq[scored], seq[scored + 1])
    completion_lengths = [len(f[k]) for f in features for k in ("chosen_input_ids", "rejected_input_ids")]
    assert torch.bincount(seq[scored], minlength=2 * n).tolist() == completion_lengths
    assert torch.equal(batch.completion_mask, labels[None] != IGNORE_INDEX)
    assert torch.equal(batch.completion_positions, scored)


def test_packed_and_padded_agree_per_sequence() -> None:
    features = _random_features(random.Random(11), 4)
    packed, padded = PackedPairCollator()(features), PaddedPairCollator()(features)
    for s in range(8):
        in_seq = packed.sequence_index[0] == s
        width = int(padded.attention_mask[s].sum())
        assert torch.equal(packed.input_ids[0, in_seq], padded.input_ids[s, :width])
        assert torch.equal(packed.labels[0, in_seq], padded.labels[s, :width])
    assert packed.num_sequences == padded.num_sequences == 8


@pytest.mark.parametrize(
    "feature",
    [
        {"prompt_input_ids": [1, 2], "chosen_input_ids": [], "rejected_input_ids": [3]},
        {"prompt_input_ids": [1, 2], "chosen_input_ids": [3], "rejected_input_ids": []},
        {"prompt_input_ids": [], "chosen_input_ids": [3], "rejected_input_ids": [4, 5]},
    ],
)
@pytest.mark.parametrize("collator", [PackedPairCollator(), PaddedPairCollator()])
def test_empty_completion_raises(feature, collator) -> None:
    good = EXAMPLE[0]
    with pytest.raises(PreferenceRowError) as info:
        collator([good, feature])
    assert info.value.reason_code == "empty_completion"
    assert "feature 1" in str(info.value)


def test_missing_column_and_empty_batch() -> None:
    with pytest.raises(KeyError, match="rejected_input_ids"):
        PackedPairCollator()([{"prompt_input_ids": [1], "chosen_input_ids": [2]}])
    with pytest.raises(ValueError):
        PackedPairCollator()([])
    with pytest.raises(ValueError):
        PackedPairCollator(pad_to_multiple_of=0)


def test_to_and_dataloader_roundtrip() -> None:
    batch = PackedPairCollator()(EXAMPLE)
    moved = batch.to("cpu", non_blocking=True)
    assert isinstance(moved, PackedPairBatch) and moved.max_seqlen == batch.max_seqlen
    assert torch.equal(moved.input_ids, batch.input_ids)
    loader = torch.utils.data.DataLoader(EXAMPLE * 4, batch_size=2, collate_fn=PackedPairCollator())
    batches = list(loader)
    assert len(batches) == 2 and all(isinstance(b, PackedPairBatch) and b.num_pairs == 2 for b in batches)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs an accelerator")
def test_pin_memory() -> None:
    pinned = PackedPairCollator()(EXAMPLE).pin_memory()
    assert isinstance(pinned, PackedPairBatch) and pinned.input_ids.is_pinned()
    on_gpu = pinned.to("cuda", non_blocking=True)
    assert on_gpu.cu_seqlens.is_cuda and on_gpu.max_seqlen == 5


def test_split_pairs_reads_the_collators_layout() -> None:
    chosen, rejected = split_pairs(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert chosen.tolist() == [1.0, 3.0] and rejected.tolist() == [2.0, 4.0]
    stats = torch.arange(12.0).reshape(4, 3)  # [2n, k] per-sequence statistics split along the first dimension
    assert [t.tolist() for t in split_pairs(stats)] == [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 10, 11]]]
    with pytest.raises(ValueError):
        split_pairs(torch.zeros(3))
