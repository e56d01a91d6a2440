"""Once per node: the node's local main process does a piece of work, the node's other ranks receive its result.

Used for what every rank of a node would otherwise repeat: tokenising the datasets (the other ranks then
memory-map the Arrow files it wrote) and hashing the reference snapshot (the other ranks check its proof).

Details: parallel/README.md, "Module notes", ``node.py``.
"""

from __future__ import annotations

import itertools
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple, TypeVar

from pair_dpo_trainer.errors import Preempted, ScheduleError, freeze_exception, thaw_exception
from pair_dpo_trainer.parallel.agreement import all_gather_cpu

T = TypeVar("T")

HEARTBEAT_SECONDS = 5.0
"""How often a working local main publishes its heartbeat (and how often the waiting ranks look)."""

_calls = itertools.count()  # the n-th once() of this process: the same n on every rank


class Shared(NamedTuple):
    """What :meth:`Node.once` returns on one rank (a ``(value, here)`` tuple, the shape ``data`` expects of a
    once-per-node runner).

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
        node_id: Global rank of this node's local main process.
        is_local_main: This process is its node's local main process.
        world_size: Processes in the job.
        stall_timeout: Seconds without a heartbeat after which the waiting ranks give up (``ddp_timeout``).
        store: A ``torch.distributed.Store`` shared by the job (None: the default process group's).
    """

    node_id: int = 0
    is_local_main: bool = True
    world_size: int = 1
    stall_timeout: float = 1800.0
    store: Any = None

    def once(self, work: Callable[[], T]) -> Shared:
        """Runs ``work`` on the local main only; returns its result on every rank of the node (module docstring).

        Raises:
            Whatever ``work`` raised on this node's local main, on every rank of the node.
            ScheduleError: ``local_main_stalled`` when a node's local main published no heartbeat for
                ``stall_timeout`` seconds.
        """
        if self.world_size <= 1:
            return Shared(work(), True)
        store = self.store if self.store is not None else _default_store()
        prefix = f"pair_dpo_trainer/once/{next(_calls)}/"
        nodes = sorted(set(all_gather_cpu(self.node_id)))
        error: BaseException | None = None
        if self.is_local_main:
            outcome, error = _run_with_heartbeat(work, store, f"{prefix}{self.node_id}/beat")
            store.set(f"{prefix}{self.node_id}/done", pickle.dumps(outcome))
        for node in nodes:
            _wait_for(store, f"{prefix}{node}", node, self.stall_timeout)
        ok, value = pickle.loads(store.get(f"{prefix}{self.node_id}/done"))
        if error is not None:
            raise error
        if not ok:
            raise thaw_exception(value)
        return Shared(value, self.is_local_main)


def _default_store() -> Any:
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _run_with_heartbeat(work: Callable[[], Any], store: Any, beat_key: str) -> tuple[tuple[bool, Any], Any]:
    """``((ok, value or frozen exception), the exception or None)``, with a heartbeat published while it runs."""
    stop = threading.Event()

    def beat() -> None:
        for count in itertools.count():
            store.set(beat_key, str(count))
            if stop.wait(HEARTBEAT_SECONDS):
                return

    thread = threading.Thread(target=beat, name="pair-dpo-heartbeat", daemon=True)
    thread.start()
    try:
        return (True, work()), None
    except (Exception, Preempted) as exc:  # shared with the node's ranks (a stop signal stops them too), then raised
        return (False, freeze_exception(exc)), exc
    finally:
        stop.set()
        thread.join()


def _wait_for(store: Any, prefix: str, node: int, stall_timeout: float) -> None:
    """Returns once ``prefix/done`` is published; raises ``local_main_stalled`` after ``stall_timeout`` seconds
    without a new heartbeat under ``prefix/beat``."""
    done, beat_key = f"{prefix}/done", f"{prefix}/beat"
    last_beat, since = None, time.monotonic()
    while True:
        try:
            store.wait([done], timedelta(seconds=HEARTBEAT_SECONDS))
            return
        except RuntimeError:  # DistStoreError: not published yet
            pass
        beat = store.get(beat_key) if store.check([beat_key]) else None
        if beat != last_beat:
            last_beat, since = beat, time.monotonic()
        elif time.monotonic() - since > stall_timeout:
            raise ScheduleError(
                "local_main_stalled",
                f"the local main process of node {node} (global rank {node}) published no heartbeat for "
                f"{stall_timeout:.0f} s while tokenising or verifying for its node's ranks: it is stuck (look at its "
                "stack, e.g. with py-spy dump), or raise ddp_timeout if it is only slow.",
            )
