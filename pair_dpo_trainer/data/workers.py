"""Tokenising on every core: an ordered, bounded map of one function over chunks of rows, in worker processes.

Rows are cut into chunks of a fixed size (:data:`CHUNK_ROWS`, never a function of the worker count) and results come
back in chunk order, so whatever the number of workers the caller sees the same sequence of results: the same
accepted rows in the same order, the same rejection counts and examples, and byte-identical files written from them.

Details: data/README.md, "Module notes", ``workers.py``.
"""

from __future__ import annotations

import collections
import itertools
import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, TypeVar

from pair_dpo_trainer.errors import FrozenException, freeze_exception, thaw_exception
from pair_dpo_trainer.stop_signals import worker_stop_filter

T = TypeVar("T")
R = TypeVar("R")

CHUNK_ROWS = 256
"""Rows per chunk (one task, one Arrow record batch of the output). Fixed: outputs do not depend on the workers."""

MAX_NUM_PROC = 32
"""Upper bound of the default worker count (more rarely pays: each worker holds a tokenizer and its own memory)."""

_worker_fn: Callable[[Any], Any] | None = None


def default_num_proc() -> int:
    """The usable cores of this process (``len(os.sched_getaffinity(0))``), at most :data:`MAX_NUM_PROC`."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_NUM_PROC))


def resolve_num_proc(num_proc: int | None) -> int:
    """``num_proc`` itself, or :func:`default_num_proc` for None."""
    return default_num_proc() if num_proc is None else int(num_proc)


def ordered_map(fn: Callable[[T], R], tasks: Iterable[T], *, num_proc: int) -> Iterator[R]:
    """Yields ``fn(task)`` for every task, in task order, computed by ``num_proc`` worker processes.

    Args:
        fn: A picklable callable (inherited by forked workers; pickled once per worker under ``spawn``).
        tasks: The chunks, consumed lazily (at most ``2 * num_proc + 2`` ahead of the caller).
        num_proc: Worker processes; 1 (or a single task) runs everything in this process.

    Raises:
        Whatever ``fn`` raised for the first failing task, as itself.
    """
    stream = iter(tasks)
    head = list(itertools.islice(stream, 2))
    if num_proc <= 1 or len(head) < 2 or multiprocessing.current_process().daemon:  # a daemon cannot fork workers
        for task in itertools.chain(head, stream):
            yield fn(task)
        return
    yield fn(head[0])  # here first: the lazy imports and caches of a first call are then inherited by the workers
    yield from _pool_map(fn, itertools.chain(head[1:], stream), num_proc)


def _pool_map(fn: Callable[[T], R], tasks: Iterator[T], num_proc: int) -> Iterator[R]:
    limit = 2 * num_proc + 2
    executor = ProcessPoolExecutor(
        max_workers=num_proc, mp_context=_context(), initializer=_init_worker, initargs=(fn, os.getpid())
    )
    pending: collections.deque[Future] = collections.deque()
    try:
        for task in tasks:
            pending.append(executor.submit(_run_task, task))
            if len(pending) >= limit:
                yield _result(pending.popleft())
        while pending:
            yield _result(pending.popleft())
    finally:
        for future in pending:
            future.cancel()
        executor.shutdown(wait=True, cancel_futures=True)


def _context() -> Any:
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def _init_worker(fn: Callable[[Any], Any], main_pid: int) -> None:
    """In a new worker: a stop signal for the job leaves it to the caller (which stops, cancels and shuts the pool
    down: temporary files are removed), its own shutdown and its death still end the worker."""
    global _worker_fn
    worker_stop_filter(main_pid)
    _worker_fn = fn


def _run_task(task: Any) -> tuple[bool, Any]:
    """In a worker: ``(True, fn(task))``, or ``(False, FrozenException)`` (exceptions do not all pickle)."""
    try:
        return True, _worker_fn(task)  # type: ignore[misc]
    except BaseException as exc:  # re-raised in the caller, as itself
        return False, freeze_exception(exc)


def _result(future: Future) -> Any:
    ok, value = future.result()
    if not ok:
        assert isinstance(value, FrozenException)
        raise thaw_exception(value)
    return value
