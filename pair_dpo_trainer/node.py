"""Once per node: the node's local main process does a piece of work, the node's other ranks receive its result.

Used for what every rank of a node would otherwise repeat: tokenising the datasets (the other ranks then
memory-map the Arrow files it wrote) and hashing the reference snapshot (the other ranks check its proof).

:meth:`Node.once` on every rank of a job, in the same order:

1. the local main process (``local_process_index == 0``) runs ``work()`` while the node's other ranks wait in
   ``TrainingArguments.main_process_first(local=True)`` (a barrier of the default process group, so the wait is
   bounded by ``ddp_timeout``, not by the short timeout of the agreement checks);
2. every rank all-gathers ``(host, is local main, outcome)`` over the CPU group; each rank takes the outcome of the
   local main of its host.

The outcome is the value, or the exception ``work()`` raised: it is then raised on every rank of the node (as
itself, reason code included, see :mod:`pair_dpo_trainer.portable`) instead of leaving them waiting. A single
process (no process group) just runs ``work()``.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pair_dpo_trainer.distributed import all_gather_cpu
from pair_dpo_trainer.portable import freeze_exception, thaw_exception

T = TypeVar("T")


@dataclass(frozen=True)
class Shared:
    """What :meth:`Node.once` returns on one rank.

    Attributes:
        value: The local main's result.
        here: This rank is the local main (it ran ``work()`` itself).
    """

    value: Any
    here: bool


@dataclass(frozen=True)
class Node:
    """This process's place on its node.

    Attributes:
        is_local_main: This process is its node's local main process.
        world_size: Processes in the job.
        first: A context manager factory in which the local main runs first (the others wait at its start).
    """

    is_local_main: bool = True
    world_size: int = 1
    first: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    @classmethod
    def from_args(cls, args: Any) -> Node:
        """The node of a ``TrainingArguments`` process (its local index, world size and ``main_process_first``)."""
        return cls(
            is_local_main=args.local_process_index == 0,
            world_size=args.world_size,
            first=lambda: args.main_process_first(local=True, desc="pair_dpo_trainer once-per-node work"),
        )

    def once(self, work: Callable[[], T]) -> Shared:
        """Runs ``work`` on the local main only; returns its result on every rank of the node (module docstring).

        Raises:
            Whatever ``work`` raised on this node's local main, on every rank of the node.
        """
        if self.world_size <= 1:
            return Shared(work(), True)
        outcome: tuple[bool, Any] = (True, None)
        error: Exception | None = None
        with self.first():
            if self.is_local_main:
                try:
                    outcome = (True, work())
                except Exception as exc:  # shared with the node's ranks, then raised on each
                    outcome, error = (False, freeze_exception(exc)), exc
        host = socket.gethostname()
        gathered = all_gather_cpu((host, self.is_local_main, outcome if self.is_local_main else None))
        mains = [entry[2] for entry in gathered if entry[0] == host and entry[1]]
        if not mains:
            raise RuntimeError(f"no local main process (local_process_index 0) reported from host {host!r}")
        ok, value = mains[0]
        if error is not None:
            raise error
        if not ok:
            raise thaw_exception(value)
        return Shared(value, self.is_local_main)
