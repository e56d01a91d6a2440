"""Which ranks are gone after a collective failed, named with their hosts.

A collective that lost a peer or timed out says only that some other rank is missing (gloo names a socket address at
most). While a run trains, a daemon thread of every rank publishes a heartbeat in the job's key-value store every
:data:`BEAT_SECONDS`; the thread runs even while its rank waits inside a collective (torch releases the GIL there).
After a failure a rank marks itself as a witness of it, then watches every heartbeat for :data:`WATCH_SECONDS`: the
ranks whose heartbeat does not move and that did not witness the failure are the lost ones (dead, stopped, or on a
lost node; a witness may have exited already, its own error in hand). When the store itself no longer answers, the
node that serves it (rank 0's: torchrun's agent there, or rank 0 itself) is the one lost.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any

BEAT_SECONDS = 2.0
"""How often each rank's heartbeat moves (one small store write per rank)."""
WATCH_SECONDS = 2 * BEAT_SECONDS
"""How long a rank that saw a collective fail watches the heartbeats."""
_POLL_SECONDS = 0.25
_sessions = itertools.count()  # the n-th roll call of this process: the same n on every rank


class RollCall:
    """The heartbeats of one run's ranks (a collective to create: every rank creates one, in the same order).

    Args:
        rank: This process's global rank.
        world_size: Ranks in the job.
        store: A ``torch.distributed.Store`` of the job (None: the default process group's).
    """

    def __init__(self, rank: int, world_size: int, store: Any = None) -> None:
        self.rank, self.world_size = rank, world_size
        self.prefix = f"pair_dpo_trainer/alive/{next(_sessions)}/"
        self.store = store
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> RollCall | None:
        """Starts this rank's heartbeat (a daemon thread); None when the job has no key-value store to beat in."""
        if self.store is None:
            try:
                self.store = _default_store()
            except Exception:  # noqa: BLE001 - no default store (a group built without one): no names then
                return None
        self._thread = threading.Thread(target=self._beat, name="pair-dpo-alive", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Ends the heartbeat (waits a moment for the thread, never for a store that stopped answering)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def _beat(self) -> None:
        for count in itertools.count():
            try:
                self.store.set(f"{self.prefix}{self.rank}", str(count))
            except Exception:  # noqa: BLE001 - the store is gone: nothing left to tell
                return
            if self._stop.wait(BEAT_SECONDS):
                return

    def absent(self, seconds: float = WATCH_SECONDS) -> list[int] | None:
        """The ranks that neither witnessed the failure nor beat within ``seconds``; None when the store does not
        answer. Marks this rank as a witness first."""
        store = self.store
        beats = [f"{self.prefix}{r}" for r in range(self.world_size)]
        witnessed = [f"{self.prefix}witness/{r}" for r in range(self.world_size)]
        try:
            store.set(witnessed[self.rank], "1")
            first = [store.get(key) if store.check([key]) else None for key in beats]
            deadline = time.monotonic() + seconds
            still = set(range(self.world_size)) - {self.rank}
            while still and time.monotonic() < deadline:
                time.sleep(_POLL_SECONDS)
                still = {r for r in still if not self._alive(r, first[r], beats[r], witnessed[r])}
        except Exception:  # noqa: BLE001 - any store failure means the store's host is gone
            return None
        return sorted(still)

    def _alive(self, rank: int, first: bytes | None, beat: str, witnessed: str) -> bool:
        if self.store.check([witnessed]):
            return True
        return bool(self.store.check([beat])) and self.store.get(beat) != first


def describe_lost(absent: list[int] | None, hosts: Sequence[str], *, seconds: float = WATCH_SECONDS) -> str:
    """Who is lost, for an error message: the ``absent`` ranks by host, or rank 0's node when the store is gone.

    Args:
        absent: :meth:`RollCall.absent`'s answer.
        hosts: Every rank's host name, in rank order.
        seconds: How long the heartbeats were watched, for the message.
    """
    if absent is None:
        host = hosts[0] if hosts else "?"
        return (
            f"the job's key-value store no longer answers, so the node serving it is lost: rank 0's node (host "
            f"{host}, where torchrun's agent or rank 0 serves the store)"
        )
    if not absent:
        return f"every rank answered within {seconds:g} s (a lost connection, no lost rank)"
    by_host: dict[str, list[int]] = {}
    for r in absent:
        by_host.setdefault(hosts[r] if r < len(hosts) else "?", []).append(r)
    listing = "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} (host {host})"
        for host, ranks in by_host.items()
    )
    return f"{listing}: no heartbeat for {seconds:g} s after the failure"


def _default_store() -> Any:
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()
