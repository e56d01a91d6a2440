"""State that objectives carry across optimizer steps: BCO's running reward mean (the reward shift delta).

Correct across gradient accumulation and ranks: each micro-batch adds its reward sums to a pending device tensor
(no host sync); at the optimizer-step boundary the pending sums are all-reduced once (a device collective) and
folded into the running total, so every micro-batch of step ``s`` on every rank reads the same delta, the mean over
all pairs of steps ``< s`` (the current step's rewards never enter its own delta, which keeps the gradient
independent of the DP x GA layout). Across checkpoints: :func:`write_objective_state` / :func:`read_objective_state`
store the total beside the checkpoint (``pair_dpo_objective_state.json``) and a resume continues from it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from pair_dpo_trainer.atomic import atomic_open, read_regular
from pair_dpo_trainer.errors import ConfigError
from pair_dpo_trainer.losses.base import PairLogps
from pair_dpo_trainer.parallel.collectives import all_reduce_if_distributed

OBJECTIVE_STATE_FILENAME = "pair_dpo_objective_state.json"
OBJECTIVE_STATE_FORMAT = 1
OBJECTIVE_STATE_MAX_BYTES = 2**20
"""A state record larger than this is not read (the record is a few numbers)."""


class RunningRewardMean:
    """BCO's delta: the mean implicit reward ``beta * u`` over both completions of every pair of every completed step.

    Args:
        device: Where the running sums live (the training device).

    Example:
        >>> state = RunningRewardMean(torch.device("cpu"))
        >>> float(state.delta())
        0.0
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._total = torch.zeros(2, dtype=torch.float64, device=self.device)  # (reward sum, reward count)
        self._pending = torch.zeros(2, dtype=torch.float64, device=self.device)

    def delta(self) -> torch.Tensor:
        """The reward shift for the next step, a float32 scalar on the device (0 before the first step)."""
        total, count = self._total[0], self._total[1]
        return torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total)).to(torch.float32)

    def observe(self, logps: PairLogps, beta: float) -> None:
        """Adds one training micro-batch's chosen and rejected rewards to the pending sums (device only)."""
        rewards = (logps.chosen_rewards(beta) + logps.rejected_rewards(beta)).detach().to(torch.float64)
        count = torch.full((), 2.0 * rewards.shape[0], dtype=torch.float64, device=rewards.device)
        self._pending += torch.stack([rewards.sum(), count]).to(self.device)

    def fold(self) -> None:
        """At an optimizer-step boundary: sums the pending rewards over ranks and adds them to the total.

        A collective in multi-process runs: every rank calls it once per optimizer step.
        """
        pending = self._pending.clone()
        all_reduce_if_distributed(pending)
        self._total += pending
        self._pending.zero_()

    def state_dict(self) -> dict[str, float]:
        """The running total as plain floats (a host sync: call at checkpoint time only)."""
        reward_sum, reward_count = self._total.tolist()
        return {"reward_sum": reward_sum, "reward_count": reward_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` output; the pending sums start empty."""
        values = [float(state["reward_sum"]), float(state["reward_count"])]
        self._total = torch.tensor(values, dtype=torch.float64, device=self.device)
        self._pending.zero_()


def write_objective_state(checkpoint_dir: str | os.PathLike[str], state: dict[str, Any]) -> Path:
    """Atomically writes ``pair_dpo_objective_state.json`` (sorted keys) into an existing checkpoint directory."""
    target = Path(checkpoint_dir) / OBJECTIVE_STATE_FILENAME
    with atomic_open(target) as f:
        f.write(json.dumps({"format": OBJECTIVE_STATE_FORMAT, **state}, sort_keys=True, indent=2) + "\n")
    return target


def read_objective_state(checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Reads the objective state of a checkpoint.

    Raises:
        ConfigError: ``objective_state_missing`` when the checkpoint has none (it was written by a run without a
            stateful objective, or by another program) or the file is not a format-1 record.
    """
    target = Path(checkpoint_dir) / OBJECTIVE_STATE_FILENAME
    try:
        data = json.loads(read_regular(target, limit=OBJECTIVE_STATE_MAX_BYTES))
    except (OSError, ValueError):
        data = None
    if not isinstance(data, dict) or data.get("format") != OBJECTIVE_STATE_FORMAT:
        raise ConfigError(
            "objective_state_missing",
            f"{target} is missing or unreadable, so the state of a stateful objective (BCO's running reward mean) "
            "at this checkpoint is unknown: resume from a checkpoint written by PairDPOTrainer with the same "
            "loss_type, or start a new run.",
        )
    return data
