"""How a collective failure is named (the real 2-process stalls are in tests/test_run_faults.py)."""

from __future__ import annotations

import os

import pytest

from pair_dpo_trainer.parallel.collectives import collective_failure, nccl_timeout_problem


def _raise_through(frames: list[tuple[str, str]], message: str) -> RuntimeError:
    """Raises ``RuntimeError(message)`` from a chain of functions compiled as if defined in the given files."""
    namespace: dict = {}
    callee = None
    for filename, name in reversed(frames):  # innermost first
        body = f"def {name}():\n    " + (f"{callee}()" if callee else f"raise RuntimeError({message!r})")
        exec(compile(body, filename, "exec"), namespace)
        callee = name
    try:
        namespace[frames[0][1]]()
    except RuntimeError as exc:
        return exc
    raise AssertionError("nothing raised")


SITE = os.path.join(os.sep, "venv", "lib", "python3.11", "site-packages")


def test_a_gloo_timeout_names_the_collective_its_caller_the_rank_and_ddp_timeout():
    exc = _raise_through(
        [
            (os.path.join(SITE, "transformers", "trainer.py"), "_maybe_log_save_evaluate"),
            (os.path.join(SITE, "transformers", "trainer_pt_utils.py"), "distributed_concat"),
            (os.path.join(SITE, "torch", "distributed", "c10d_logger.py"), "wrapper"),
            (os.path.join(SITE, "torch", "distributed", "distributed_c10d.py"), "all_gather"),
        ],
        "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation to complete",
    )
    error = collective_failure(exc, timeout_s=20, rank=3)
    assert error is not None and error.reason_code == "collective_timeout"
    text = str(error)
    assert "rank 3" in text and "ddp_timeout=20 s" in text
    assert "the collective all_gather (called from transformers/trainer_pt_utils.py:distributed_concat)" in text


def test_a_timeout_inside_the_guarded_all_reduce_names_the_caller_of_the_helper():
    """The metrics' reduction goes through ``all_reduce_if_distributed``: the message names who asked for it."""
    package = os.path.join(os.sep, "work", "pair_dpo_trainer")
    exc = _raise_through(
        [
            (os.path.join(package, "observability", "metrics.py"), "reduce"),
            (os.path.join(package, "parallel", "collectives.py"), "all_reduce_if_distributed"),
            (os.path.join(SITE, "torch", "distributed", "c10d_logger.py"), "wrapper"),
            (os.path.join(SITE, "torch", "distributed", "distributed_c10d.py"), "all_reduce"),
        ],
        "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation to complete",
    )
    text = str(collective_failure(exc, timeout_s=20, rank=1))
    assert "the collective all_reduce (called from pair_dpo_trainer/observability/metrics.py:reduce)" in text


def test_a_closed_connection_is_peer_lost_and_an_unrelated_timeout_is_left_alone():
    lost = _raise_through(
        [(os.path.join(SITE, "torch", "distributed", "distributed_c10d.py"), "barrier")],
        "Read error [127.0.0.1]:29500: Connection reset by peer",
    )
    assert collective_failure(lost, timeout_s=60, rank=0).reason_code == "peer_lost"
    unrelated = _raise_through([(os.path.join(SITE, "requests", "api.py"), "get")], "Read timed out")
    assert collective_failure(unrelated, timeout_s=60, rank=0) is None
    assert collective_failure(ValueError("timeout"), timeout_s=60, rank=0) is None


def test_nccl_error_handling_switched_off_is_a_problem_unless_blocking_wait():
    assert nccl_timeout_problem({}) is None
    assert nccl_timeout_problem({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}) is None
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=0" in nccl_timeout_problem({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"})
    assert nccl_timeout_problem({"NCCL_ASYNC_ERROR_HANDLING": "0"}) is not None
    assert nccl_timeout_problem({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_BLOCKING_WAIT": "1"}) is None


# ---------------------------------------------------------------------------------------------- naming the lost ranks
def _stores(count: int) -> tuple[object, list]:
    """A TCPStore server and ``count`` clients of it (a job's store as its ranks see it)."""
    import datetime

    import torch.distributed as dist

    from tests.ports import free_port

    port, timeout = free_port(), datetime.timedelta(seconds=5)
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timeout)
    return server, [dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout) for _ in range(count)]


@pytest.mark.integration
def test_the_roll_call_names_ranks_without_heartbeat_and_spares_the_witnesses():
    """Ranks 0-2 beat; rank 3 never does (dead). Rank 1 stops beating but witnessed the failure (it left with its own
    error in hand): only rank 3 is lost, named with its host."""
    from pair_dpo_trainer.parallel.roll_call import RollCall, describe_lost

    server, clients = _stores(4)
    calls = [RollCall(rank, 4, store=clients[rank]) for rank in range(4)]
    prefixes = {call.prefix for call in calls}
    for call in calls:  # one process plays every rank: give them the prefix every rank of one session shares
        call.prefix = calls[0].prefix
    assert len(prefixes) == 4  # (each RollCall of a process is a new session)
    for call in calls[:3]:
        call.start()
    calls[1].stop()
    calls[1].absent(seconds=0.1)  # rank 1 witnessed the failure, then exits
    try:
        absent = calls[0].absent(seconds=2.5)
    finally:
        for call in calls:
            call.stop()
    assert absent == [3]
    hosts = ["node0", "node0", "node1", "node1"]
    assert describe_lost(absent, hosts) == "rank 3 (host node1): no heartbeat for 4 s after the failure"
    assert describe_lost([2, 3], hosts).startswith("ranks 2, 3 (host node1)")


def test_a_store_that_no_longer_answers_names_rank_0_s_node():
    from pair_dpo_trainer.parallel.roll_call import RollCall, describe_lost

    server, (client,) = _stores(1)
    call = RollCall(0, 2, store=client)
    del server  # the server goes with its process (its node)
    assert call.absent(seconds=1) is None
    assert "rank 0's node (host node0" in describe_lost(None, ["node0", "node1"])


def test_a_collective_failure_carries_the_lost_ranks_and_only_a_failure_asks_for_them():
    asked = []

    def lost():
        asked.append(1)
        return "rank 3 (host node1): no heartbeat for 4 s after the failure"

    exc = _raise_through(
        [(os.path.join(SITE, "torch", "distributed", "distributed_c10d.py"), "all_reduce")],
        "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:4100",
    )
    error = collective_failure(exc, timeout_s=60, rank=0, lost=lost)
    assert error is not None and error.reason_code == "peer_lost"
    assert "Lost: rank 3 (host node1): no heartbeat" in str(error)
    assert collective_failure(RuntimeError("CUDA out of memory"), timeout_s=60, rank=0, lost=lost) is None
    assert asked == [1]
