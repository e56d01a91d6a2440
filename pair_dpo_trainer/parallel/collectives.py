"""A stalled or dead peer ends the job within ``ddp_timeout``, with a message naming the collective and the timeout.

Two gaps close here:

Details: parallel/README.md, "Module notes", ``collectives.py``.
"""

from __future__ import annotations

import datetime
import logging
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pair_dpo_trainer.errors import ConfigError, RunError
from pair_dpo_trainer.parallel import agreement

logger = logging.getLogger(__name__)

_DDP_PATH = f"torch{os.sep}nn{os.sep}parallel{os.sep}"
_COMM_PATHS = (f"torch{os.sep}distributed{os.sep}", f"deepspeed{os.sep}comm{os.sep}", _DDP_PATH)
_HELPER_PATHS = (
    *_COMM_PATHS,
    f"pair_dpo_trainer{os.sep}parallel{os.sep}agreement.py",
    f"pair_dpo_trainer{os.sep}parallel{os.sep}collectives.py",
)  # skipped when naming the caller
_TIMEOUT_MARKERS = ("timed out", "timeout")
_PEER_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused")


def end_process_group() -> None:
    """Ends the job's process groups (every rank together) before a process exits on purpose.

    Called on every rank right before :class:`~pair_dpo_trainer.fault_tolerance.preemption.TrainingPreempted` is
    raised and
    at the end of ``train.py``. A gloo group still alive at interpreter exit can abort the process from a C++
    destructor ("terminate called without an active exception", exit status -6 instead of 75) when a peer exits
    first; CI saw it on one rank of two. The barrier makes sure no peer is still in a collective when the groups go.
    A caller that catches ``TrainingPreempted`` and wants to go on must start a new process group.
    """
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def all_reduce_if_distributed(tensor: torch.Tensor, op: Any = None) -> None:
    """All-reduces ``tensor`` in place over the default process group (``op``: a ``torch.distributed.ReduceOp``,
    SUM when None) when one is initialised, whatever its size; outside a process group ``tensor`` is left as it is.

    A collective inside a process group: every rank calls it, in the same order as its other collectives. A failure
    is named after this function's caller (:func:`collective_failure`).
    """
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op)


def apply_collective_timeout(seconds: float) -> int:
    """Sets ``seconds`` as the timeout of every existing process group (and of the CPU group if created later).

    Returns:
        The number of groups updated (0 outside a process group).
    """
    timeout = datetime.timedelta(seconds=seconds)
    agreement.set_group_timeout(timeout)
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    from torch.distributed import distributed_c10d as c10d

    set_timeout = getattr(c10d, "_set_pg_timeout", None)
    if set_timeout is None:  # pragma: no cover - torch without the API: the groups keep their own timeouts
        logger.warning("this torch cannot change a process group's timeout: ddp_timeout applies to NCCL groups only")
        return 0
    updated = 0
    for group in list(c10d._world.pg_map):
        try:
            set_timeout(timeout, group)
            updated += 1
        except (ValueError, RuntimeError, AssertionError):
            continue  # a group this rank is not part of, or a backend without timeouts
    return updated


def check_nccl_error_handling(environ: Any = os.environ) -> None:
    """Refuses an NCCL run whose environment switched the collective timeout off (see :func:`nccl_timeout_problem`).

    Raises:
        ConfigError: ``unsupported_combination``.
    """
    if not (dist.is_available() and dist.is_initialized()) or "nccl" not in str(dist.get_backend()):
        return
    problem = nccl_timeout_problem(environ)
    if problem is not None:
        raise ConfigError("unsupported_combination", problem)


def nccl_timeout_problem(environ: Any) -> str | None:
    """Why NCCL collectives would never time out under ``environ``, or None.

    ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (or the older ``NCCL_ASYNC_ERROR_HANDLING``) set to 0 without
    ``TORCH_NCCL_BLOCKING_WAIT=1`` leaves a timed-out collective unhandled.
    """
    handling = environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", environ.get("NCCL_ASYNC_ERROR_HANDLING"))
    blocking = environ.get("TORCH_NCCL_BLOCKING_WAIT", environ.get("NCCL_BLOCKING_WAIT", "0"))
    if handling is None or handling.strip() != "0" or blocking.strip() == "1":
        return None
    return (
        "TORCH_NCCL_ASYNC_ERROR_HANDLING=0 without TORCH_NCCL_BLOCKING_WAIT=1 turns off NCCL's collective timeout: a "
        "stalled or dead rank would hang every other rank forever instead of ending the job after ddp_timeout. Unset "
        "TORCH_NCCL_ASYNC_ERROR_HANDLING (torch's default, 3, tears the process down on a timeout) or set "
        "TORCH_NCCL_BLOCKING_WAIT=1."
    )


def collective_failure(
    exc: BaseException, *, timeout_s: float, rank: int, lost: Callable[[], str | None] | None = None
) -> RunError | None:
    """The :class:`RunError` for a collective that timed out or lost its peer, or None for any other error.

    Args:
        exc: The exception raised inside training.
        timeout_s: The run's ``ddp_timeout`` in seconds, for the message.
        rank: This process's global rank.
        lost: Names the lost ranks and their hosts (``roll_call.py``; it may watch their heartbeats for a few
            seconds), called only for a collective failure; None or a None answer: the message names none.
    """
    if not isinstance(exc, RuntimeError):  # gloo raises RuntimeError; torch's DistError subclasses it
        return None
    text = str(exc)
    lowered = text.lower()
    peer_lost = any(marker in lowered for marker in _PEER_MARKERS)
    timed_out = any(marker in lowered for marker in _TIMEOUT_MARKERS)
    where = _collective_of(exc)
    if where is None or not (peer_lost or timed_out):
        return None
    detail = text.strip().splitlines()[0][:300] if text.strip() else type(exc).__name__
    who = lost() if lost is not None else None
    lost_text = f" Lost: {who}." if who else ""
    if peer_lost:
        return RunError(
            "peer_lost",
            f"rank {rank}: another rank died or closed its connection during {where}: the job stops (check the "
            f"other ranks' logs for the first error; resume with --resume_from_checkpoint latest).{lost_text} "
            f"Backend: {detail}",
        )
    return RunError(
        "collective_timeout",
        f"rank {rank}: {where} did not complete within ddp_timeout={timeout_s:g} s: another rank is stalled "
        "(stopped, swapping, blocked on storage or the network) or dead, so this rank stops instead of waiting "
        "forever. Check the other ranks' logs and the hosts, then resume with --resume_from_checkpoint latest "
        f"(raise --ddp_timeout if steps or saves legitimately take longer).{lost_text} Backend: {detail}",
    )


def _collective_of(exc: BaseException) -> str | None:
    """Names the collective an exception came from (from its traceback), or None when it came from elsewhere."""
    frames = traceback.extract_tb(exc.__traceback__)
    comm = [i for i, frame in enumerate(frames) if any(path in frame.filename for path in _COMM_PATHS)]
    if comm:
        outer = comm[0]
        while outer > 0 and any(path in frames[outer].filename for path in _HELPER_PATHS):
            outer -= 1
        ops = [frames[i] for i in comm if frames[i].name not in ("wrapper", "inner", "<lambda>")]
        innermost = ops[-1] if ops else frames[comm[-1]]
        op = innermost.name.lstrip("_").removeprefix("distributed_")
        owner = " of DDP" if _DDP_PATH in innermost.filename else ""
        caller = frames[outer]
        return f"the collective {op}{owner} (called from {_short(caller.filename)}:{caller.name})"
    names = {frame.name for frame in frames}
    if names & {"backward", "_engine_run_backward", "run_backward"}:
        return "the DDP gradient all-reduce in backward (a collective)"
    return None


def _short(filename: str) -> str:
    """``.../site-packages/transformers/trainer_pt_utils.py`` -> ``transformers/trainer_pt_utils.py``."""
    parts = filename.replace(os.sep, "/").split("/")
    if "pair_dpo_trainer" in parts:
        return "/".join(parts[len(parts) - 1 - parts[::-1].index("pair_dpo_trainer") :])
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) + 1 :])
    return "/".join(parts[-2:])
