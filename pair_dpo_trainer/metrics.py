"""Pair metrics accumulated on the device and reduced only when the Trainer logs.

``update`` adds pair-weighted sums into one small device tensor (no host sync); ``reduce`` sums it over ranks and
moves it to the host once per logging event.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from pair_dpo_trainer.loss import PairLogps

METRIC_NAMES = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


class PairMetrics:
    """Device-side sums of per-pair metrics plus host-side throughput counters.

    The device tensor has ``len(METRIC_NAMES) + 1`` float64 entries: the weighted sums and, last, the total weight
    (pair count, or the sum of eval pair weights where padded duplicates weigh 0).
    """

    def __init__(self) -> None:
        self._sums: torch.Tensor | None = None
        self._tokens = 0
        self._pairs = 0
        self._started = time.perf_counter()

    def update(
        self,
        logps: PairLogps,
        losses: torch.Tensor,
        beta: float,
        weights: torch.Tensor | None = None,
        num_tokens: int = 0,
    ) -> None:
        """Adds one micro-batch. Tensors are ``[n]``; ``num_tokens`` is the host-known packed length."""
        chosen = logps.chosen_rewards(beta).detach()
        rejected = logps.rejected_rewards(beta).detach()
        columns = torch.stack(
            [
                losses.detach(),
                chosen,
                rejected,
                chosen - rejected,
                (chosen > rejected).to(chosen.dtype),
                logps.policy_chosen_logps.detach(),
                logps.policy_rejected_logps.detach(),
            ]
        ).to(torch.float64)
        w = torch.ones_like(columns[0]) if weights is None else weights.to(columns.dtype)
        sums = torch.cat([(columns * w).sum(dim=1), w.sum().reshape(1)])
        self._sums = sums if self._sums is None else self._sums + sums
        self._tokens += int(num_tokens)
        self._pairs += int(logps.policy_chosen_logps.shape[0])

    def reduce(self, device: torch.device, prefix: str = "") -> dict[str, float]:
        """Sums over ranks, returns pair-weighted means and throughput, and resets. Call on every rank."""
        sums = self._sums if self._sums is not None else torch.zeros(len(METRIC_NAMES) + 1, dtype=torch.float64)
        counters = torch.tensor([self._tokens, self._pairs], dtype=torch.float64)
        packed = torch.cat([sums.to(device), counters.to(device)])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(packed)
        values = packed.cpu().tolist()
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        total_weight = values[len(METRIC_NAMES)]
        out: dict[str, float] = {}
        if total_weight > 0:
            out = {f"{prefix}{name}": values[i] / total_weight for i, name in enumerate(METRIC_NAMES)}
        out[f"{prefix}tokens_per_second"] = values[-2] / elapsed
        out[f"{prefix}pairs_per_second"] = values[-1] / elapsed
        self.reset()
        return out

    def reset(self) -> None:
        """Forgets every sum and restarts the throughput clock."""
        self._sums = None
        self._tokens = 0
        self._pairs = 0
        self._started = time.perf_counter()
