"""Pair metrics accumulated on the device and reduced only when the Trainer logs.

``update`` adds weighted sums into one small device tensor (no host sync); ``reduce`` sums it over ranks and moves it
to the host once per logging event. Names are TRL 1.16's where the quantity is the same (docs/losses.md lists them):

Details: observability/README.md, "Module notes", ``metrics.py``.
"""

from __future__ import annotations

import difflib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pair_dpo_trainer.collators.batch import split_pairs
from pair_dpo_trainer.losses import PairLogps
from pair_dpo_trainer.parallel.collectives import all_reduce_if_distributed

METRIC_NAMES = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)
"""Pair-weighted means, in the order of the device sums."""

TOKEN_METRIC_NAMES = ("logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy")
"""Token-weighted means from the per-token statistics of the policy pass (``modeling.chunked_head.TOKEN_STATS``)."""


def _token_sums(logps: PairLogps, token_stats: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``[8]`` numerators then denominators of :data:`TOKEN_METRIC_NAMES` (``token_stats``: ``[2n, 4]`` sums)."""
    stats = token_stats.detach().to(torch.float64)
    chosen, rejected = split_pairs(stats)
    n_chosen = logps.chosen_token_counts.to(torch.float64)
    n_rejected = logps.rejected_token_counts.to(torch.float64)
    numerators = torch.stack([chosen[:, 0], rejected[:, 0], chosen[:, 1] + rejected[:, 1], chosen[:, 2]])
    denominators = torch.stack([n_chosen, n_rejected, n_chosen + n_rejected, n_chosen])
    return torch.cat([(numerators * w).sum(dim=1), (denominators * w).sum(dim=1)])


class PairMetrics:
    """Device-side sums of per-pair and per-token metrics plus host-side throughput counters.

    Args:
        components: The objective's component names; ``loss/<name>`` is logged for each when there are several.
    """

    def __init__(self, components: Sequence[str] = ()) -> None:
        self.components = tuple(components) if len(components) > 1 else ()
        self.pair_names = METRIC_NAMES + tuple(f"loss/{name}" for name in self.components)
        self._width = len(self.pair_names) + 1 + 2 * len(TOKEN_METRIC_NAMES)
        self._sums: torch.Tensor | None = None
        self._tokens = 0
        self._packed_tokens = 0
        self._pairs = 0
        self._unfolded_tokens = 0
        self._started = time.perf_counter()

    def update(
        self,
        logps: PairLogps,
        losses: torch.Tensor,
        beta: float,
        weights: torch.Tensor | None = None,
        num_tokens: int = 0,
        *,
        components: Mapping[str, torch.Tensor] | None = None,
        token_stats: torch.Tensor | None = None,
        packed_tokens: int | None = None,
        counts_pairs: bool = True,
    ) -> None:
        """Adds one micro-batch. Tensors are ``[n]`` (``token_stats`` ``[2n, 4]`` per-sequence sums, or None);
        ``num_tokens`` is the host-known token count as TRL computes it (each prompt twice), ``packed_tokens`` the
        tokens packed and computed (a shared prompt once; default ``num_tokens``); ``counts_pairs`` False leaves the
        pairs out of the throughput (the other ranks of a sequence-parallel group, whose first rank counts them)."""
        chosen = logps.chosen_rewards(beta).detach()
        rejected = logps.rejected_rewards(beta).detach()
        columns = [
            losses.detach(),
            chosen,
            rejected,
            chosen - rejected,
            (chosen > rejected).to(chosen.dtype),
            logps.policy_chosen_logps.detach(),
            logps.policy_rejected_logps.detach(),
        ]
        columns += [components[name].detach() for name in self.components] if components else []
        stacked = torch.stack([c.to(torch.float64) for c in columns])
        w = torch.ones_like(stacked[0]) if weights is None else weights.to(stacked.dtype)
        if token_stats is None:
            token_part = stacked.new_zeros(2 * len(TOKEN_METRIC_NAMES))
        else:
            token_part = _token_sums(logps, token_stats, w)
        sums = torch.cat([(stacked * w).sum(dim=1), w.sum().reshape(1), token_part])
        self._sums = sums if self._sums is None else self._sums + sums
        self._tokens += int(num_tokens)
        self._packed_tokens += int(num_tokens if packed_tokens is None else packed_tokens)
        self._unfolded_tokens += int(num_tokens)
        self._pairs += int(logps.policy_chosen_logps.shape[0]) if counts_pairs else 0

    def reduce(self, device: torch.device, prefix: str = "", totals: Any = None) -> dict[str, float]:
        """Sums over ranks, returns the means and throughput, and resets. Call on every rank.

        Args:
            device: Device of the collective.
            prefix: Prepended to every name (``"eval_"``).
            totals: The ``TrainerState`` of a training run: its ``num_input_tokens_seen`` gains this window's
                tokens and is logged as ``num_tokens``. None: no ``num_tokens`` (evaluation).
        """
        sums = self._sums if self._sums is not None else torch.zeros(self._width, dtype=torch.float64)
        counters = torch.tensor(
            [self._packed_tokens, self._tokens, self._pairs, self._unfolded_tokens], dtype=torch.float64
        )
        packed = torch.cat([sums.to(device), counters.to(device)])
        all_reduce_if_distributed(packed)
        values = packed.cpu().tolist()
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        pairs_width = len(self.pair_names)
        total_weight = values[pairs_width]
        out: dict[str, float] = {}
        if total_weight > 0:
            out = {f"{prefix}{name}": values[i] / total_weight for i, name in enumerate(self.pair_names)}
        token_values = values[pairs_width + 1 : pairs_width + 1 + 2 * len(TOKEN_METRIC_NAMES)]
        for i, name in enumerate(TOKEN_METRIC_NAMES):
            numerator, denominator = token_values[i], token_values[len(TOKEN_METRIC_NAMES) + i]
            if denominator > 0:
                out[f"{prefix}{name}"] = numerator / denominator
        out[f"{prefix}tokens_per_second"] = values[-3] / elapsed
        out[f"{prefix}packed_tokens_per_second"] = values[-4] / elapsed
        out[f"{prefix}pairs_per_second"] = values[-2] / elapsed
        if totals is not None:
            totals.num_input_tokens_seen += int(round(values[-1]))
            out[f"{prefix}num_tokens"] = float(totals.num_input_tokens_seen)
        self.reset()
        return out

    def fold_tokens(self, device: torch.device, totals: Any) -> None:
        """Adds the tokens since the last log (all ranks) to ``totals.num_input_tokens_seen`` without logging, so a
        checkpoint's ``trainer_state.json`` holds the exact count. A collective: call on every rank."""
        pending = torch.tensor([float(self._unfolded_tokens)], dtype=torch.float64, device=device)
        all_reduce_if_distributed(pending)
        totals.num_input_tokens_seen += int(round(pending.item()))
        self._unfolded_tokens = 0

    def reset(self) -> None:
        """Forgets every sum and restarts the throughput clock."""
        self._sums = None
        self._tokens = 0
        self._packed_tokens = 0
        self._pairs = 0
        self._unfolded_tokens = 0
        self._started = time.perf_counter()


def report_to_problems(report_to: Sequence[str] | None) -> list[tuple[str, str]]:
    """``report_to_unavailable`` for each logging integration of ``report_to`` (``TrainingArguments.report_to``, a list
    once the config is built) that transformers does not know or whose package is not installed: the Trainer would
    raise for it only once the model is loaded."""
    from transformers.integrations.integration_utils import (
        INTEGRATION_TO_CALLBACK,
        get_available_reporting_integrations,
    )

    available = set(get_available_reporting_integrations())
    problems = []
    for name in report_to or ():
        if name not in INTEGRATION_TO_CALLBACK:
            close = difflib.get_close_matches(name, list(INTEGRATION_TO_CALLBACK), n=1)
            fix = f"did you mean {close[0]!r}?" if close else f"one of {', '.join(sorted(INTEGRATION_TO_CALLBACK))}."
            problems.append(("report_to_unavailable", f"report_to {name!r} is not a logging integration: {fix}"))
        elif name not in available:
            problems.append(
                (
                    "report_to_unavailable",
                    f"report_to {name!r}: its package is not installed. Install it (pip install {name}), or drop it "
                    "from --report_to (--report_to none logs to the console and trainer_state.json only).",
                )
            )
    return problems
