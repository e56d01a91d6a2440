"""Building each micro-batch's :class:`~pair_dpo_trainer.losses.base.StepContext`: what step-level objectives
need from the whole optimizer step, computed once per step before its first forward.

- ``bco_pair_shift``: the reward shift delta of the previous steps (``training.objective_state.RunningRewardMean``).
- ``sft``: chosen tokens per pair of the step, from the micro-batches on the host (no device sync) and one device
  all-reduce over ranks; ``orpo`` likewise with the chosen prompt tokens counted too.
- ``aot`` / ``aot_unpaired``: a gradient-free pass of the policy and the reference over the step's micro-batches
  (``margins_fn``), the margins of every rank gathered (one device all-gather), and each pair's sort-matched partner.

Collective: every rank calls :meth:`StepContextBuilder.for_step` once per optimizer step, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from pair_dpo_trainer.collators.batch import PackedPairBatch
from pair_dpo_trainer.losses.aot import sort_matched
from pair_dpo_trainer.losses.base import AotMatch, PairLogps, StepContext
from pair_dpo_trainer.losses.objective import Objective
from pair_dpo_trainer.parallel.agreement import is_multiprocess
from pair_dpo_trainer.training.objective_state import RunningRewardMean

MarginsFn = Callable[[PackedPairBatch], PairLogps]
"""A micro-batch (on the device) -> its per-pair log-probs without gradient (the AOT pre-pass)."""


def chosen_scored_tokens(batch: PackedPairBatch) -> torch.Tensor:
    """Scored tokens of the chosen sequences (even sequence indices) of a micro-batch, an int64 scalar on the
    batch's device (a CPU batch costs no device sync)."""
    return (batch.scored_sequences() % 2 == 0).sum()


def chosen_sequence_targets(batch: PackedPairBatch) -> int:
    """Tokens after the first of every chosen sequence of a (host) micro-batch: the targets of ORPO's NLL."""
    lengths = (batch.cu_seqlens[1 : batch.num_sequences + 1] - batch.cu_seqlens[: batch.num_sequences]).tolist()
    return sum(length - 1 for length in lengths[::2])


def _step_tokens_per_pair(
    batches: Sequence[PackedPairBatch], device: torch.device, count: Callable[[PackedPairBatch], int]
) -> torch.Tensor:
    """``count`` tokens / pairs over the step's micro-batches on every rank: a float64 device scalar (a 0-dim
    tensor, so the float32 losses it divides stay float32)."""
    tokens = sum(count(batch) for batch in batches)  # CPU batches: host arithmetic
    pairs = sum(batch.num_pairs for batch in batches)
    totals = torch.tensor([tokens, pairs], dtype=torch.float64, device=device)
    if is_multiprocess():
        dist.all_reduce(totals)
    return totals[0] / totals[1].clamp(min=1)


def _gather_rows(local: torch.Tensor, rows_per_rank: int) -> torch.Tensor:
    """All ranks' ``[p_r, k]`` rows in rank order, each rank's block padded to ``rows_per_rank`` (host-known, the
    same on every rank: no size exchange, no host sync) with ``+inf``, which sorts last and so is never a real
    row's partner (every column gets the same number of pads)."""
    if local.shape[0] > rows_per_rank:
        raise ValueError(f"{local.shape[0]} pairs on this rank exceed the step's {rows_per_rank} pairs per rank")
    padded = torch.full((rows_per_rank, local.shape[1]), float("inf"), dtype=local.dtype, device=local.device)
    padded[: local.shape[0]] = local
    if not is_multiprocess():
        return padded
    rows = [torch.empty_like(padded) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, padded)
    return torch.cat(rows)


def _aot_matches(batches: Sequence[PackedPairBatch], margins_fn: MarginsFn, rows_per_rank: int) -> list[AotMatch]:
    """Each micro-batch's sort-matched partners over the global step (see :mod:`pair_dpo_trainer.losses.aot`)."""
    columns = []
    with torch.no_grad():
        for batch in batches:
            logps = margins_fn(batch)
            policy_margin = logps.policy_chosen_logps - logps.policy_rejected_logps
            ref_margin = logps.ref_chosen_logps - logps.ref_rejected_logps
            logratios = [logps.chosen_logratios(), logps.rejected_logratios()]
            columns.append(torch.stack([policy_margin, ref_margin, *logratios], 1))
    local = torch.cat(columns).to(torch.float64)
    rows = _gather_rows(local, rows_per_rank)
    pairs = ((0, 1), (2, 3), (3, 2))  # aot: policy vs reference margins; aot_unpaired: chosen vs rejected, both ways
    partners = torch.stack([sort_matched(rows[:, x], rows[:, y]) for x, y in pairs], 1)
    rank = dist.get_rank() if is_multiprocess() else 0
    mine = partners[rank * rows_per_rank : rank * rows_per_rank + local.shape[0]]
    matches, start = [], 0
    for block in columns:
        part = mine[start : start + block.shape[0]].to(block.dtype)
        matches.append(AotMatch(ref_margins=part[:, 0], rejected_logratios=part[:, 1], chosen_logratios=part[:, 2]))
        start += block.shape[0]
    return matches


class StepContextBuilder:
    """The step contexts a run's objective needs (nothing for objectives without step-level quantities).

    Args:
        objective: The run's objective.
        bco_state: BCO's running reward mean when ``bco_pair_shift`` is a component, else None.
    """

    def __init__(self, objective: Objective, bco_state: RunningRewardMean | None) -> None:
        self.objective = objective
        self.bco_state = bco_state
        self.token_mean = objective.needs("token_mean")
        self.sequence_nll = objective.needs("sequence_nll")
        self.sorts_step = objective.needs("sorts_step")

    @property
    def active(self) -> bool:
        """True when some component reads a step context."""
        return self.token_mean or self.sequence_nll or self.sorts_step or self.bco_state is not None

    def _delta(self) -> torch.Tensor | float:
        return 0.0 if self.bco_state is None else self.bco_state.delta()

    def for_step(
        self,
        batches: Sequence[PackedPairBatch],
        device: torch.device,
        *,
        margins_fn: MarginsFn | None = None,
        pairs_per_rank: int | None = None,
    ) -> list[StepContext]:
        """One context per micro-batch of an optimizer step.

        Args:
            batches: The step's micro-batches on this rank, still on the host.
            device: The training device.
            margins_fn: The gradient-free pre-pass (needed by ``aot`` / ``aot_unpaired``).
            pairs_per_rank: The step's pairs per rank, host-known and equal on every rank (AOT only).
        """
        tokens = _step_tokens_per_pair(batches, device, _chosen_tokens) if self.token_mean else None
        sequence = _step_tokens_per_pair(batches, device, chosen_sequence_targets) if self.sequence_nll else None
        if self.sorts_step:
            if margins_fn is None or pairs_per_rank is None:
                raise ValueError("aot / aot_unpaired need margins_fn and pairs_per_rank for the step's pre-pass")
            matches: list[AotMatch | None] = list(_aot_matches(batches, margins_fn, pairs_per_rank))
        else:
            matches = [None] * len(batches)
        delta = self._delta()
        return [
            StepContext(
                bco_delta=delta, chosen_tokens_per_pair=tokens, aot=match, chosen_sequence_tokens_per_pair=sequence
            )
            for match in matches
        ]

    def for_microbatch(self, logps: PairLogps, weights: torch.Tensor | None = None) -> StepContext:
        """A micro-batch on its own (evaluation): delta of the training so far, this micro-batch's chosen tokens per
        (weighted) pair, and AOT sorted within the micro-batch."""
        tokens = _weighted_mean(logps.chosen_token_counts, weights) if self.token_mean else None
        sequence = None
        if self.sequence_nll and logps.chosen_prompt_token_counts is not None:
            sequence = _weighted_mean(logps.chosen_token_counts + logps.chosen_prompt_token_counts, weights)
        return StepContext(
            bco_delta=self._delta(), chosen_tokens_per_pair=tokens, chosen_sequence_tokens_per_pair=sequence
        )


def _chosen_tokens(batch: PackedPairBatch) -> int:
    return int(chosen_scored_tokens(batch))


def _weighted_mean(counts: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """The (pair-weighted) mean of per-pair token counts, float64 (eval fillers weigh 0)."""
    values = counts.to(torch.float64)
    w = torch.ones_like(values) if weights is None else weights.to(values.dtype)
    return (values * w).sum() / w.sum().clamp(min=1e-12)
