"""One run per output directory, a stalled or dead rank, and preemption: real processes, real signals.

Multi-rank cases launch tests/fault_worker.py once per rank with ``RANK`` / ``WORLD_SIZE`` set (as ``srun`` or a
launcher would), so that one rank can be signalled and every rank's exit code is seen.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pair_dpo_trainer.errors import RunError
from pair_dpo_trainer.fault_tolerance import PREEMPTED_EXIT_CODE
from pair_dpo_trainer.fault_tolerance import lock as lock_module
from pair_dpo_trainer.fault_tolerance.checkpoint import checkpoint_problem, list_checkpoints, read_manifest
from pair_dpo_trainer.fault_tolerance.lock import (
    LOCK_FILENAME,
    TAKE_OVER_ENV,
    LockHolder,
    OutputDirLock,
    acquire_output_dir,
    judge,
    process_start_ticks,
    release_output_dir,
)
from pair_dpo_trainer.fault_tolerance.preemption import PREEMPTED_MARKER
from tests.ds_worker import full_parameters
from tests.fault_worker import build
from tests.faults import (
    assert_same_parameters,
    final_state,
    kill_all,
    launch,
    launch_torchrun,
    logs,
    outcome,
    run_spec,
    run_to_end,
    signal_rank_after,
    wait,
    wait_for_progress,
)

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- output-dir lock
def _lock_record(directory: Path, **fields) -> Path:
    holder = {**LockHolder.current().__dict__, **fields}
    path = directory / LOCK_FILENAME
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(holder))
    return path


def test_a_live_holder_on_this_host_is_refused_and_named(tmp_path):
    holder = OutputDirLock(tmp_path)  # another open file of the lock: its kernel lock excludes this process too
    assert holder.acquire() is None
    try:
        with pytest.raises(RunError) as refused:
            OutputDirLock(tmp_path).acquire()
        assert refused.value.reason_code == "output_dir_in_use" and "kernel lock" in str(refused.value)
        assert f"pid {os.getpid()}" in str(refused.value) and socket.gethostname() in str(refused.value)
        assert json.loads((tmp_path / LOCK_FILENAME).read_text())["token"] == holder.holder.token
    finally:
        holder.release()
    assert not (tmp_path / LOCK_FILENAME).exists()


def test_the_holder_refreshes_its_heartbeat_in_place(tmp_path, monkeypatch):
    monkeypatch.setattr(lock_module, "HEARTBEAT_SECONDS", 0.05)
    holder = OutputDirLock(tmp_path)
    holder.acquire()
    try:
        path = tmp_path / LOCK_FILENAME
        first, inode = json.loads(path.read_text())["heartbeat"], path.stat().st_ino
        deadline = time.monotonic() + 10
        while json.loads(path.read_text())["heartbeat"] == first and time.monotonic() < deadline:
            time.sleep(0.05)
        assert json.loads(path.read_text())["heartbeat"] > first and path.stat().st_ino == inode  # same file
    finally:
        holder.release()


def test_a_reused_pid_or_another_boot_is_a_dead_holder_and_is_taken_over(tmp_path):
    parent = {"pid": os.getppid(), "start_ticks": process_start_ticks(os.getppid())}  # alive: judged by the rest
    for fields in ({**parent, "start_ticks": -1}, {**parent, "boot_id": "an-earlier-boot"}):
        _lock_record(tmp_path, token="stale", **fields)
        lock = OutputDirLock(tmp_path)
        warning = lock.acquire()
        assert warning is not None and "no longer alive" in warning
        assert json.loads((tmp_path / LOCK_FILENAME).read_text())["token"] == lock.holder.token
        lock.release()
        assert not (tmp_path / LOCK_FILENAME).exists()


def test_a_holder_on_another_host_or_a_foreign_file_is_never_taken_over(tmp_path):
    _lock_record(tmp_path, host="node-17", pid=1, token="remote")
    with pytest.raises(RunError) as refused:
        OutputDirLock(tmp_path).acquire()
    assert "node-17" in str(refused.value) and f"delete {tmp_path / LOCK_FILENAME}" in str(refused.value)
    (tmp_path / LOCK_FILENAME).write_text("not json")
    with pytest.raises(RunError) as foreign:
        OutputDirLock(tmp_path).acquire()
    assert foreign.value.reason_code == "output_dir_in_use" and "not a pair_dpo lock record" in str(foreign.value)


def test_a_holder_that_cannot_be_proven_dead_is_taken_over_only_by_its_own_token(tmp_path, monkeypatch):
    _lock_record(tmp_path, host="node-17", pid=1, token="0123abcd")
    with pytest.raises(RunError) as refused:
        OutputDirLock(tmp_path).acquire()
    assert f"{TAKE_OVER_ENV}=0123abcd" in str(refused.value) and "last heartbeat was" in str(refused.value)
    monkeypatch.setenv(TAKE_OVER_ENV, "another-holding")
    with pytest.raises(RunError):
        OutputDirLock(tmp_path).acquire()
    monkeypatch.setenv(TAKE_OVER_ENV, "0123abcd")
    lock = OutputDirLock(tmp_path)
    warning = lock.acquire()
    assert warning is not None and f"as {TAKE_OVER_ENV} asks" in warning and "node-17" in warning
    assert json.loads((tmp_path / LOCK_FILENAME).read_text())["token"] == lock.holder.token
    with pytest.raises(RunError) as live:  # never a holding whose kernel lock is held, whatever the token
        monkeypatch.setenv(TAKE_OVER_ENV, lock.holder.token)
        OutputDirLock(tmp_path).acquire()
    assert "kernel lock" in str(live.value)
    lock.release()


def test_what_proves_a_holder_dead_without_its_kernel_lock():
    """Another kernel's holder (a network filesystem, where flock may be per client) is dead only when its machine
    rebooted: on a filesystem only this kernel mounts, or by a heartbeat older than this boot."""
    now = LockHolder.current()
    other_boot = dataclasses.replace(now, boot_id="an-earlier-boot")
    stale = dataclasses.replace(other_boot, heartbeat="2000-01-01T00:00:00+00:00")
    assert judge(other_boot, "taken", local_filesystem=True)[0]
    assert not judge(other_boot, "taken", local_filesystem=False)[0]  # a live twin with the same host name?
    assert judge(stale, "taken", local_filesystem=False)[0]
    assert not judge(now, "busy", local_filesystem=True)[0]
    assert judge(now, "taken", local_filesystem=False)[0]  # same kernel: its flock would have refused this one
    no_flock = dataclasses.replace(now, kernel_lock=False, pid_namespace="pid:[1]")
    assert not judge(no_flock, "unsupported", local_filesystem=False)[0]  # another namespace: pids prove nothing
    dead_pid = dataclasses.replace(now, kernel_lock=False, pid=_dead_pid())
    assert judge(dead_pid, "unsupported", local_filesystem=False) == (True, f"no process {dead_pid.pid} exists")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.integration
def test_two_runs_starting_at_the_same_instant_get_one_lock(tmp_path):
    out, start = tmp_path / "out", time.time() + 2  # both processes are up by then, and race for the lock
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LOCK_HOLDER_START_AT": str(start)}
    procs = [
        subprocess.Popen(
            [*LOCK_HOLDER, "hold", str(out), str(tmp_path / f"{i}.ready")], env=env, stderr=subprocess.PIPE
        )
        for i in range(2)
    ]
    try:
        deadline = time.monotonic() + 60
        while sum(p.poll() is not None or (tmp_path / f"{i}.ready").exists() for i, p in enumerate(procs)) < 2:
            assert time.monotonic() < deadline, "the lock holders did not start"
            time.sleep(0.05)
        time.sleep(0.5)
        holders = [i for i, p in enumerate(procs) if p.poll() is None]
        assert len(holders) == 1 and [p.returncode for p in procs if p.poll() is not None] == [1]
        (refused,) = [p.stderr.read().decode() for p in procs if p.poll() is not None]
        assert "output_dir_in_use" in refused and "kernel lock" in refused
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(30)


def _unshare_refusal() -> str | None:
    """Why this machine cannot run a process in a new PID namespace (None: it can)."""
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    try:
        done = subprocess.run(UNSHARE + ["true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare --pid --fork --mount-proc failed: {exc}"
    return None if done.returncode == 0 else f"unshare --pid --fork --mount-proc refused: {done.stderr.strip()}"


UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc"]
LOCK_HOLDER = [sys.executable, str(ROOT / "tests" / "lock_holder.py")]


def _hold(directory: Path, ready: Path, *prefix: str, fork: bool = False) -> subprocess.Popen:
    proc = subprocess.Popen([*prefix, *LOCK_HOLDER, "hold", str(directory), str(ready), *(["fork"] if fork else [])])
    deadline = time.monotonic() + 60
    while not (ready.exists() and ready.read_text().endswith("\n")) and proc.poll() is None:
        assert time.monotonic() < deadline, "the lock holder did not start"
        time.sleep(0.05)
    return proc


def _try(directory: Path, *prefix: str) -> dict:
    done = subprocess.run([*prefix, *LOCK_HOLDER, "try", str(directory)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.integration
@pytest.mark.skipif(_unshare_refusal() is not None, reason=str(_unshare_refusal()))
def test_a_lock_held_in_another_pid_namespace_is_refused_and_a_dead_holders_is_taken_over(tmp_path):
    """Containers sharing a host name and a volume: the kernel lock, not the pid, tells whether the holder lives."""
    for name, holder_ns, contender_ns in (("in", [], UNSHARE), ("out", [*UNSHARE, "--kill-child"], [])):
        out = tmp_path / name
        holder = _hold(out, tmp_path / f"{name}.ready", *holder_ns, fork=True)
        try:
            result = _try(out, *contender_ns)
            held_in = (tmp_path / f"{name}.ready").read_text().split()[1]
            assert result["pid_namespace"] != held_in  # really two PID namespaces
            assert result["outcome"] == "refused" and result["reason_code"] == "output_dir_in_use", result
            assert "kernel lock" in result["message"]
        finally:
            holder.kill()  # SIGKILL: no clean-up; its forked child still runs (a DataLoader worker would)
            holder.wait(30)
    child = int((tmp_path / "in.ready").read_text().splitlines()[1])
    try:
        result = _try(tmp_path / "in", *UNSHARE)  # at once, while the holder's child still lives
        assert result["outcome"] == "acquired" and "no longer alive" in result["warning"], result
    finally:
        os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("point", ["fsync_dir", "_hold"])  # the name is linked / the record is about to be ours
def test_a_stop_signal_while_the_lock_is_taken_leaves_no_lock_file(tmp_path, point):
    """A real SIGTERM, sent by this process to itself as ``point`` starts inside the lock's acquisition (the handler
    of a run's start is installed): ``Preempted``, and no lock file of this holding stays for the next run to take
    over with a warning."""
    from pair_dpo_trainer.errors import Preempted
    from pair_dpo_trainer.fault_tolerance.preemption import stop_on_signal

    def signal_at_point(frame, event, arg):  # the first call of ``point`` from the lock's code
        caller = frame.f_back
        if event == "call" and frame.f_code.co_name == point and caller and caller.f_globals is vars(lock_module):
            sys.setprofile(None)
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(Preempted), stop_on_signal("taking the output-dir lock"):
        sys.setprofile(signal_at_point)
        try:
            acquire_output_dir(tmp_path)
        finally:
            sys.setprofile(None)
    assert not (tmp_path / LOCK_FILENAME).exists(), (tmp_path / LOCK_FILENAME).read_text()
    assert acquire_output_dir(tmp_path) is None  # taken afresh, not over a "dead" holder
    release_output_dir(tmp_path)
    assert not (tmp_path / LOCK_FILENAME).exists()


def test_the_lock_is_reentrant_in_one_process_and_released_by_its_last_holder(tmp_path):
    assert acquire_output_dir(tmp_path) is None and acquire_output_dir(tmp_path) is None
    release_output_dir(tmp_path)
    assert (tmp_path / LOCK_FILENAME).exists()
    release_output_dir(tmp_path)
    assert not (tmp_path / LOCK_FILENAME).exists()


@pytest.mark.slow
def test_a_second_run_on_the_same_output_dir_refuses_at_start_and_the_first_is_untouched(tmp_path):
    """The second run is a trainer of this process (the refusal from launched processes, every rank of them: the
    distributed test below); the first is a real process holding the output_dir mid-run."""
    first = run_spec(tmp_path, "a", max_steps=12, hold_until=str(tmp_path / "go"))  # waits after step 1
    second = {**run_spec(tmp_path, "b", max_steps=4, seed=1), "out": first["out"]}
    procs = launch([first], tmp_path / "a")
    try:
        wait_for_progress(first, 0, 1, procs, timeout=200)
        with pytest.raises(RunError) as refused:
            build(second).train()
        assert refused.value.reason_code == "output_dir_in_use", refused.value
        message = str(refused.value)
        assert f"pid {procs[0].pid}" in message and socket.gethostname() in message
        assert json.loads((Path(first["out"]) / LOCK_FILENAME).read_text())["pid"] == procs[0].pid  # still held
        (tmp_path / "go").touch()
        assert wait(procs, 300) == [0], logs(tmp_path / "a")
    finally:
        kill_all(procs)
    assert outcome(first)["global_step"] == 12
    assert [step for step, _ in list_checkpoints(first["out"])] == [2, 4, 6, 8, 10, 12]
    assert not (Path(first["out"]) / LOCK_FILENAME).exists()  # released on a normal exit


@pytest.mark.slow
def test_the_lock_of_a_killed_run_is_taken_over_and_its_checkpoints_resume(tmp_path, caplog):
    spec = run_spec(tmp_path, "a", max_steps=12, step_sleep=0.3)
    procs = launch([spec], tmp_path / "a")
    try:
        wait_for_progress(spec, 0, 5, procs, timeout=120)
        os.kill(procs[0].pid, signal.SIGKILL)
        assert wait(procs, 30) == [-9]
    finally:
        kill_all(procs)
    lock = json.loads((Path(spec["out"]) / LOCK_FILENAME).read_text())
    assert lock["pid"] == procs[0].pid and lock["host"] == socket.gethostname()
    trainer = build({**spec, "step_sleep": 0})
    trainer.train(resume_from_checkpoint="latest")
    assert f"pid {procs[0].pid}" in caplog.text and "no longer alive" in caplog.text
    assert trainer.state.global_step == 12


@pytest.mark.slow
@pytest.mark.distributed
def test_every_rank_refuses_when_the_main_process_finds_the_output_dir_in_use(tmp_path):
    spec = run_spec(tmp_path, "run", max_steps=2)
    assert acquire_output_dir(spec["out"]) is None  # held by this (live) test process
    try:
        codes = run_to_end([spec], tmp_path / "run", world_size=2, timeout=300)
    finally:
        release_output_dir(spec["out"])
    assert codes == [1, 1], logs(tmp_path / "run")
    for rank in (0, 1):
        result = outcome(spec, rank)
        assert result["reason_code"] == "output_dir_in_use" and f"pid {os.getpid()}" in result["message"]
    assert list_checkpoints(spec["out"]) == []


# ---------------------------------------------------------------------------------------------- stalled / dead rank
STALL_TIMEOUT = 10


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("fault", "code", "named"),
    [
        ({"kind": "stop", "where": "step_end"}, "collective_timeout", "the collective all_reduce"),
        ({"kind": "stop", "where": "backward"}, "collective_timeout", "the DDP gradient all-reduce in backward"),
        ({"kind": "die"}, "peer_lost", "another rank died"),
    ],
)
@pytest.mark.integration
def test_a_stalled_or_dead_rank_ends_the_other_rank_within_ddp_timeout_naming_the_collective(
    tmp_path, fault, code, named
):
    spec = run_spec(tmp_path, "run", max_steps=20, save_steps=100, ddp_timeout=STALL_TIMEOUT)
    spec["fault"] = {**fault, "step": 3, "rank": 1}
    procs = launch([spec], tmp_path / "run", world_size=2)
    try:
        wait_for_progress(spec, 1, 2, procs, timeout=200)
        codes = wait(procs[:1], STALL_TIMEOUT + 60)
        stalled_since = max(float(line.split()[2]) for line in Path(spec["progress"]).read_text().splitlines())
    finally:
        kill_all(procs)
    assert codes[0] not in (None, 0), "rank 0 still waiting " + logs(tmp_path / "run")
    result = outcome(spec, 0)
    assert result["reason_code"] == code, result
    assert named in result["message"] and "rank 0" in result["message"]
    waited = result["time"] - stalled_since
    if code == "collective_timeout":
        assert f"ddp_timeout={STALL_TIMEOUT} s" in result["message"]
        assert STALL_TIMEOUT * 0.8 <= waited < STALL_TIMEOUT + 30, waited
    else:
        assert waited < STALL_TIMEOUT, waited  # a dead peer is noticed at once, not after the timeout


# ---------------------------------------------------------------------------------------------- preemption (SIGTERM)
@pytest.mark.slow
def test_sigterm_saves_the_current_step_exits_75_and_resume_equals_the_uninterrupted_run(tmp_path):
    spec = run_spec(tmp_path, "run", max_steps=12, save_steps=100, step_sleep=0.4)
    codes = signal_rank_after(spec, launch([spec], tmp_path / "run"), 0, 2, signal.SIGTERM, timeout=200)
    assert codes == [PREEMPTED_EXIT_CODE], logs(tmp_path / "run")
    (step, checkpoint), *_ = list_checkpoints(spec["out"])
    assert 2 <= step < 12 and checkpoint_problem(checkpoint) is None
    assert not (Path(spec["out"]) / LOCK_FILENAME).exists()
    resumed = build({**spec, "step_sleep": 0})
    resumed.train(resume_from_checkpoint="latest")
    straight = build(run_spec(tmp_path, "straight", max_steps=12, save_steps=100))
    straight.train()
    assert_same_parameters(full_parameters(straight.model), full_parameters(resumed.model))


@pytest.mark.slow
@pytest.mark.distributed
def test_sigterm_to_one_rank_stops_both_at_the_same_step_and_the_resumed_run_equals_the_uninterrupted_one(tmp_path):
    """The resume launch first trains a run whose ranks are launched without ``use_cpu`` on this CPU-only machine
    (torchrun without ``--use_cpu``): the Trainer alone would make each process the main process of its own
    world-size-1 job, both writing one output_dir. ``config.launch.resolve_use_cpu`` joins them into one gloo job:
    both ranks train the same steps and each checkpoint holds both ranks' RNG states. It runs first in fresh processes,
    as a launch of its own would, and the launch goes on to the resume and the uninterrupted run."""
    spec = run_spec(tmp_path, "run", max_steps=12, save_steps=100, step_sleep=0.4, ddp_timeout=60)
    procs = launch([spec], tmp_path / "run", world_size=2)
    codes = signal_rank_after(spec, procs, 1, 2, signal.SIGTERM, timeout=300)  # only rank 1 is signalled
    assert codes == [PREEMPTED_EXIT_CODE] * 2, logs(tmp_path / "run")
    assert outcome(spec, 0)["reason_code"] == outcome(spec, 1)["reason_code"] == "preempted"
    (step, checkpoint), *_ = list_checkpoints(spec["out"])
    assert 2 <= step < 12 and checkpoint_problem(checkpoint) is None
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(read_manifest(checkpoint)["files"])  # both ranks saved
    marker = json.loads((Path(spec["out"]) / PREEMPTED_MARKER).read_text())  # rank 0 writes it, rank 1 got SIGTERM
    assert marker["step"] == step and marker["signal"] == "SIGTERM", marker
    resume = {**spec, "step_sleep": 0, "resume": "auto", "result": spec["result"] + "_resumed"}
    straight = run_spec(tmp_path, "straight", max_steps=12, save_steps=100)
    no_cpu = run_spec(tmp_path, "no_cpu", max_steps=4, use_cpu=False)
    codes = run_to_end([no_cpu, resume, straight], tmp_path / "run", world_size=2)
    assert codes == [0, 0], logs(tmp_path / "run")
    assert_same_parameters(final_state(straight)["params"], final_state(resume)["params"])
    log = (tmp_path / "run" / "rank0.log").read_text()
    assert "world_size=2" in log[log.index("pair_dpo: world_size=") :][: len("pair_dpo: world_size=2")]  # no_cpu's
    assert [step for step, _ in list_checkpoints(no_cpu["out"])] == [2, 4]
    for _, checkpoint in list_checkpoints(no_cpu["out"]):
        assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(read_manifest(checkpoint)["files"])
    assert outcome(no_cpu, 0)["global_step"] == outcome(no_cpu, 1)["global_step"] == 4


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "workers"), [(signal.SIGTERM, 2), (signal.SIGINT, 1)], ids=["sigterm", "ctrl_c"])
def test_a_group_signal_with_dataloader_workers_saves_exits_75_and_resume_equals_the_uninterrupted_run(
    tmp_path, sig, workers
):
    """``kill -TERM -PGID`` (twice, as schedulers repeat it) or Ctrl-C (SIGINT to the foreground group) also reaches
    the DataLoader workers: they must outlive it, so the run finishes the step, saves and exits 75; the trainer's
    ``worker_init_fn`` (a user's) still runs in every worker."""
    marks = tmp_path / "marks"
    spec = run_spec(tmp_path, "run", max_steps=12, save_steps=100, step_sleep=0.4, workers=workers)
    spec["worker_marks"] = str(marks)
    procs = launch([spec], tmp_path / "run", session=True)
    try:
        wait_for_progress(spec, 0, 2, procs, timeout=200)
        os.killpg(procs[0].pid, sig)
        if sig == signal.SIGTERM:
            time.sleep(0.2)
            os.killpg(procs[0].pid, sig)
        codes = wait(procs, 200)
    finally:
        kill_all(procs)
    assert codes == [PREEMPTED_EXIT_CODE], logs(tmp_path / "run")
    assert outcome(spec)["reason_code"] == "preempted"
    (step, checkpoint), *_ = list_checkpoints(spec["out"])
    assert 2 <= step < 12 and checkpoint_problem(checkpoint) is None
    marker = json.loads((Path(spec["out"]) / PREEMPTED_MARKER).read_text())
    assert marker["step"] == step and marker["signal"] == signal.Signals(sig).name and marker["exit_code"] == 75
    assert not (Path(spec["out"]) / LOCK_FILENAME).exists()
    assert len(list(marks.iterdir())) >= workers  # the user's worker_init_fn ran in each worker
    resumed = build({**spec, "step_sleep": 0, "worker_marks": None})
    resumed.train(resume_from_checkpoint="latest")
    assert not (Path(spec["out"]) / PREEMPTED_MARKER).exists()  # a run that takes the output_dir clears it
    straight = build(run_spec(tmp_path, "straight", max_steps=12, save_steps=100))
    straight.train()
    assert_same_parameters(full_parameters(straight.model), full_parameters(resumed.model))


@pytest.mark.slow
@pytest.mark.distributed
def test_sigterm_to_torchrun_with_dataloader_workers_stops_every_rank_with_75_and_a_complete_checkpoint(tmp_path):
    """torchrun forwards SIGTERM to each rank's whole process group (``killpg``): the workers must outlive it. torchrun
    itself exits 1, so the marker file is what tells a requeue script that the run was preempted. (That the resumed
    run equals the uninterrupted one: with workers on one rank above, on two ranks without workers below.)"""
    spec = run_spec(tmp_path, "run", max_steps=12, save_steps=100, step_sleep=0.4, workers=1, ddp_timeout=60)
    launcher = launch_torchrun([spec], tmp_path / "run", nproc=2)
    try:
        wait_for_progress(spec, 1, 2, [launcher], timeout=300)
        launcher.send_signal(signal.SIGTERM)
        (code,) = wait([launcher], 200)
    finally:
        kill_all([launcher])
    assert code == 1, logs(tmp_path / "run")  # torchrun's own exit code after a signal, whatever the ranks return
    assert [outcome(spec, rank)["code"] for rank in (0, 1)] == [PREEMPTED_EXIT_CODE] * 2, logs(tmp_path / "run")
    (step, checkpoint), *_ = list_checkpoints(spec["out"])
    assert 2 <= step < 12 and checkpoint_problem(checkpoint) is None
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(read_manifest(checkpoint)["files"])
    marker = json.loads((Path(spec["out"]) / PREEMPTED_MARKER).read_text())
    assert marker["checkpoint"] == str(checkpoint) and marker["exit_code"] == 75
    assert not (Path(spec["out"]) / LOCK_FILENAME).exists()


# ---------------------------------------------------------------------------------------------- train.py
@pytest.mark.integration
@pytest.mark.parametrize("value", ["True", "latest"])
def test_train_script_resumes_from_the_newest_complete_checkpoint(tmp_path, caplog, value):
    sys.path.insert(0, str(ROOT))
    import train

    out = tmp_path / "demo"
    flags = ["--output_dir", str(out), "--eval_size", "0", "--eval_strategy", "no", "--eval_on_start", "false"]
    flags += ["--save_steps", "2", "--logging_steps", "1", "--disable_tqdm", "true", "--use_cpu", "true"]
    train.main([*flags, "--max_steps", "4"])
    (out / "checkpoint-4" / "optimizer.pt").write_bytes(b"")  # checkpoint-4 is now incomplete
    with caplog.at_level(logging.WARNING):
        train.main([*flags, "--max_steps", "6", "--resume_from_checkpoint", value])
    assert f"resuming from {out / 'checkpoint-2'}" in caplog.text
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert [e["step"] for e in history if "loss" in e] == [1, 2, 3, 4, 5, 6]
    assert read_manifest(out / "checkpoint-6")["step"] == 6 and checkpoint_problem(out / "checkpoint-4") is None
