"""Cross-rank agreement checks over a CPU (gloo) group: a disagreement is an error on every rank, never a hang.

Ranks that disagree about the schedule would run different numbers of forwards and backwards; under ZeRO-3 that
deadlocks inside a collective. These checks run once before the first step, on the CPU, with a timeout: the run's
``ddp_timeout`` once training starts (``fault_tolerance/collectives.py`` sets it on every group),
``AGREEMENT_TIMEOUT`` before.
The same group carries the few other host-side agreements of a run (stop on preemption at a step boundary, checkpoint
status).
"""

from __future__ import annotations

import datetime
import functools
from typing import Any

import torch
import torch.distributed as dist

from pair_dpo_trainer.errors import ScheduleError

AGREEMENT_TIMEOUT = datetime.timedelta(seconds=120)
_group_timeout = AGREEMENT_TIMEOUT


def set_group_timeout(timeout: datetime.timedelta) -> None:
    """The timeout of the CPU group if it is created from now on (an existing one is updated by the caller)."""
    global _group_timeout
    _group_timeout = timeout


@functools.lru_cache(maxsize=1)
def _cpu_group():
    """A gloo group over all ranks (the default group when it already is gloo). Collective: call on every rank."""
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo", timeout=_group_timeout)


def is_multiprocess() -> bool:
    """True inside an initialised process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_gather_cpu(value: Any) -> list[Any]:
    """Every rank's ``value`` (any picklable object, rank order) over the CPU group; ``[value]`` in one process.

    A collective: every rank must call it, in the same order as its other collectives.
    """
    if not is_multiprocess():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value, group=_cpu_group())
    return values


def max_over_ranks_cpu(value: int) -> int:
    """The largest ``value`` over all ranks: one 8-byte all-reduce over the CPU group (no GPU sync).

    A collective: every rank must call it at the same point (e.g. at every optimizer-step boundary).
    """
    if not is_multiprocess():
        return int(value)
    reduced = torch.tensor([int(value)], dtype=torch.int64)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=_cpu_group())
    return int(reduced[0])


def assert_ranks_agree(what: str, value: str) -> None:
    """Raises ``ScheduleError('ranks_disagree')`` on every rank unless all ranks pass the same ``value``.

    Args:
        what: Name of the compared quantity, for the message (e.g. ``"train schedule"``).
        value: A short string (typically a digest) that must be identical on all ranks.

    A single process returns at once.
    """
    values = all_gather_cpu(value)
    if len(set(values)) != 1:
        listing = ", ".join(f"rank {rank}: {v}" for rank, v in enumerate(values))
        raise ScheduleError(
            "ranks_disagree",
            f"the ranks disagree about the {what} ({listing}). Every rank must load the same dataset (same files, "
            "same preprocessing) with the same seed, batch size and gradient_accumulation_steps; otherwise they would "
            "run different numbers of forwards and hang, or each train on rows the others never see.",
        )
