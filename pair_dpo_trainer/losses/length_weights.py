"""LD-DPO's per-token weights of the scored positions: the summed log-probs of policy and reference weigh the tokens
both completions of a pair share 1 and the longer completion's tail ``alpha`` (Liu et al. 2024, arXiv:2409.06411).
Device ops only, no host sync; the log-prob code applies ``batch.token_weights`` where it sums.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pair_dpo_trainer.collators.batch import PackedPairBatch, split_pairs


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
