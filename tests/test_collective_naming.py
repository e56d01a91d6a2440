"""How a collective failure is named (the real 2-process stalls are in tests/test_run_faults.py)."""

from __future__ import annotations

import os

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
