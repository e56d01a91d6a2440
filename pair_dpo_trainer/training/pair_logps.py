"""Per-sequence log-probs of a packed micro-batch -> the per-pair :class:`~pair_dpo_trainer.losses.PairLogps` the
objectives read, in the collators' sequence order (pair i: sequence ``2i`` chosen, ``2i + 1`` rejected)."""

from __future__ import annotations

import torch

from pair_dpo_trainer.collators.batch import PackedPairBatch, split_pairs
from pair_dpo_trainer.losses import PairLogps
from pair_dpo_trainer.modeling.logprobs import SequenceLogps


def pair_logps_from_sequences(
    policy: SequenceLogps | torch.Tensor, ref_logps: torch.Tensor, batch: PackedPairBatch
) -> PairLogps:
    """Splits per-sequence ``[2n]`` log-probs into :class:`PairLogps` (the collators' layout:
    :func:`~pair_dpo_trainer.collators.batch.split_pairs`).

    ``policy`` is the policy pass (:class:`~pair_dpo_trainer.modeling.logprobs.SequenceLogps`: LD-weighted and plain
    sums,
    per-token statistics) or a plain ``[2n]`` tensor.
    """
    if isinstance(policy, torch.Tensor):
        policy = SequenceLogps(logps=policy, nll_logps=policy)
    counts = completion_token_counts(batch)
    logps, stats = policy.logps, policy.token_stats
    chosen_wpo, rejected_wpo = split_pairs(stats[:, 3]) if stats is not None else (None, None)
    (policy_chosen, policy_rejected), (ref_chosen, ref_rejected) = split_pairs(logps), split_pairs(ref_logps)
    chosen_counts, rejected_counts = split_pairs(counts)
    prompt_logps = None if policy.prompt_logps is None else split_pairs(policy.prompt_logps)[0]
    prompt_counts = None if policy.prompt_token_counts is None else split_pairs(policy.prompt_token_counts)[0]
    return PairLogps(
        policy_chosen_logps=policy_chosen,
        policy_rejected_logps=policy_rejected,
        ref_chosen_logps=ref_chosen,
        ref_rejected_logps=ref_rejected,
        chosen_token_counts=chosen_counts,
        rejected_token_counts=rejected_counts,
        policy_chosen_nll_logps=None if policy.nll_logps is logps else split_pairs(policy.nll_logps)[0],
        chosen_wpo_logps=chosen_wpo,
        rejected_wpo_logps=rejected_wpo,
        chosen_prompt_logps=prompt_logps,
        chosen_prompt_token_counts=prompt_counts,
    )


def completion_token_counts(batch: PackedPairBatch) -> torch.Tensor:
    """Completion tokens per sequence ``[2n]`` float32, computed on the device (no host sync)."""
    sequences = batch.scored_sequences()
    ones = torch.ones(sequences.shape, dtype=torch.float32, device=sequences.device)
    return torch.zeros(batch.num_sequences, device=ones.device).index_add_(0, sequences, ones)
