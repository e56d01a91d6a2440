"""DataLoader workers that only their parent can stop: a stop signal meant for the job (a process group's SIGTERM,
Ctrl-C, torchrun's ``killpg``, the deepspeed launcher's SIGTERM to every descendant) leaves them running, so the
training process finishes its step, saves and shuts them down itself.

- :class:`WorkerInit` is the trainer's ``worker_init_fn``: :func:`~pair_dpo_trainer.stop_signals.worker_stop_filter`
  first, then the user's own function (``PairDPOTrainer.worker_init_fn``) if there is one.
- :class:`StopSafeDataLoader` always has one, and forks its workers with SIGTERM and SIGINT blocked, so none arrives
  before the filter runs (the mask is inherited; a signal for the parent is delivered when the fork is done).

Details: fault_tolerance/README.md, "Module notes", ``workers.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader

from pair_dpo_trainer.stop_signals import stop_signals_blocked, worker_stop_filter


class WorkerInit:
    """A DataLoader ``worker_init_fn`` (picklable, so it also works with ``spawn`` and ``forkserver``).

    Args:
        user_fn: The user's ``worker_init_fn(worker_id)``, run after the filter (None: none).
        main_pid: The process that owns the workers (default: the one building the loader); a fork server's workers
            have another parent.
    """

    def __init__(self, user_fn: Callable[[int], Any] | None = None, main_pid: int | None = None) -> None:
        self.user_fn = user_fn
        self.main_pid = os.getpid() if main_pid is None else main_pid

    def __call__(self, worker_id: int) -> None:
        worker_stop_filter(self.main_pid)
        if self.user_fn is not None:
            self.user_fn(worker_id)


class StopSafeDataLoader(DataLoader):
    """A DataLoader whose workers only their parent can stop (see the module docstring): its ``worker_init_fn`` is
    a :class:`WorkerInit` around the one given, and its workers start with the stop signals blocked."""

    def __init__(self, *args: Any, worker_init_fn: Callable[[int], Any] | None = None, **kwargs: Any) -> None:
        kwargs["worker_init_fn"] = (
            worker_init_fn if isinstance(worker_init_fn, WorkerInit) else WorkerInit(worker_init_fn)
        )
        super().__init__(*args, **kwargs)

    def _get_iterator(self) -> Any:
        with stop_signals_blocked():
            return super()._get_iterator()
