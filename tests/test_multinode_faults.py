"""Faults across two nodes (tests/multinode.py): a node lost, a torchrun elastic restart, and Slurm preemption through
examples/slurm/train_multinode.sbatch with a fake ``srun`` / ``scontrol`` (tests/fake_slurm/) on the same harness.

Each test is one 2-node launch (the Slurm test two submissions); the runs that end are compared with the one-process
run of the session (``dp1_reference``) on the same global batches.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pair_dpo_trainer.fault_tolerance import PREEMPTED_EXIT_CODE
from pair_dpo_trainer.fault_tolerance.checkpoint import checkpoint_problem, list_checkpoints, read_manifest
from tests.multinode import NODES, ROOT, STEPS, Cluster, Job, cpu_form, kill_tree, nodelist
from tests.ports import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
RANKS = range(4)
DDP_TIMEOUT = 30
SBATCH = ROOT / "examples" / "slurm" / "train_multinode.sbatch"
FAKE_SLURM = ROOT / "tests" / "fake_slurm"


def _assert_same_parameters(got: dict, expected: dict, atol: float = 1e-5) -> None:
    assert set(got) == set(expected) and expected
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=atol, rtol=0, msg=name)


def test_a_whole_node_killed_ends_the_other_within_ddp_timeout_naming_the_lost_ranks(tmp_path):
    """SIGKILL of node 1's launcher and its two ranks (a lost machine): node 0's ranks fail at their next collective
    with ``peer_lost`` naming ranks 2 and 3 and their host, and node 0's launcher exits, well within ddp_timeout."""
    cluster = Cluster(tmp_path)
    run = {"name": "lost", "out": str(tmp_path / "shared" / "lost"), "max_steps": 200, "save_steps": 1000}
    job = Job(cluster, "lost", [{**run, "step_sleep": 0.3, "ddp_timeout": DDP_TIMEOUT}]).start("torchrun")
    try:
        job.wait_for_step("lost", 2, timeout=300)
        killed_at = time.time()
        kill_tree(job.launchers[1].pid)
        codes = job.wait(DDP_TIMEOUT + 30)
    finally:
        job.kill()
    assert codes[0] not in (None, 0) and codes[1] == -signal.SIGKILL, cluster.logs("lost")
    host1 = cluster.host(1)
    for rank in (0, 1):
        record = job.record("lost", rank)
        assert record["reason_code"] == "peer_lost", record
        assert f"Lost: ranks 2, 3 (host {host1})" in record["message"]
        assert record["time"] - killed_at < DDP_TIMEOUT, record["time"] - killed_at  # a dead peer: not a timeout


def test_torchrun_elastic_restart_resumes_from_the_newest_complete_checkpoint_and_ends_as_uninterrupted(
    tmp_path, dp1_reference
):
    """``--max-restarts 1`` with c10d and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 3 dies after step 5; both nodes'
    agents restart the job's workers, which resume from checkpoint-4 (``--resume_from_checkpoint auto``, the same
    command line that started fresh) and finish like one uninterrupted process."""
    cluster = Cluster(tmp_path)
    out = tmp_path / "shared" / "elastic"
    run = {"name": "elastic", "out": str(out), "max_steps": STEPS, "save_steps": 2, "resume": "auto"}
    run["fault"] = {"kind": "die", "step": 5, "rank": 3}
    job = Job(cluster, "elastic", [run])
    job.start("torchrun", extra=["--max-restarts", "1"], env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert job.finish(500) == [0, 0], cluster.logs("elastic")
    assert (job.results / "elastic.died").read_text() == "3 5\n"
    records = job.records("elastic")
    assert {r["resumed_from"] for r in records} == {str(out / "checkpoint-4")}
    assert {r["global_step"] for r in records} == {STEPS}
    logs = "".join(cluster.log("elastic", node) for node in range(NODES))
    assert "resume_from_checkpoint=auto: no complete checkpoint" in logs and f"resuming from {out}/checkpoint-4" in logs
    assert [step for step, _ in list_checkpoints(out)] == [2, 4, 6]
    _assert_same_parameters(torch.load(job.results / "elastic.pt")["params"], dp1_reference["params"])


# ---------------------------------------------------------------------------------------------- Slurm
def _submit(cluster: Cluster, spec: Path, log: Path, *, restart: int, env: dict[str, str]) -> subprocess.Popen:
    """Runs the sbatch script as Slurm would on the 2 nodes (its #SBATCH lines are comments to bash)."""
    path = os.pathsep.join([str(FAKE_SLURM), str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    slurm = {
        "PATH": path, "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": nodelist(cluster), "SLURM_NNODES": str(NODES),
        "SLURM_GPUS_ON_NODE": "2", "SLURM_RESTART_COUNT": str(restart), "FAKE_SLURM_CLUSTER": str(cluster.root),
        "FAKE_SLURM_LOG": str(cluster.root / "slurm.log"), "MASTER_PORT": str(free_port()),
    }  # fmt: skip
    command = ["bash", str(SBATCH), str(ROOT / "tests" / "multinode_worker.py"), str(spec)]
    return subprocess.Popen(
        command, env={**os.environ, **slurm, **env}, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip


def test_slurm_script_preemption_saves_once_exits_75_everywhere_requeues_and_the_requeued_job_resumes(
    tmp_path, dp1_reference
):
    """The script's own launch lines on the harness: submission 1 (torchrun) gets SIGTERM in its batch shell (what
    ``--signal=B:TERM@120`` sends); every rank of both nodes exits 75 after one complete checkpoint, the script
    requeues the job. Submission 2 (``SLURM_RESTART_COUNT=1``, the accelerate launch line) resumes it with the same
    command line and ends like one uninterrupted process."""
    cluster = Cluster(tmp_path)
    out = tmp_path / "shared" / "slurm"
    job = Job(cluster, "slurm", [{"name": "slurm", "out": str(out), "max_steps": STEPS, "save_steps": 1000}])
    job.runs[0].update(resume="auto", step_sleep=0.5)
    spec = job.spec_file()
    first = _submit(cluster, spec, tmp_path / "batch1.log", restart=0, env={})
    try:
        job.launchers = [first]
        job.wait_for_step("slurm", 2, timeout=300)
        first.send_signal(signal.SIGTERM)
        assert first.wait(120) == 0, (tmp_path / "batch1.log").read_text() + cluster.logs("srun")
    finally:
        kill_tree(first.pid)
    batch = (tmp_path / "batch1.log").read_text()
    assert "rendezvous node0:" in batch if cluster.isolated else "rendezvous" in batch
    assert "requeueing job 4242" in batch and (tmp_path / "slurm.log").read_text() == "requeue 4242\n"
    preempted = job.records("slurm")
    assert [r["exit"] for r in preempted] == [PREEMPTED_EXIT_CODE] * 4, preempted
    assert {r["reason_code"] for r in preempted} == {"preempted"}
    ((step, checkpoint),) = list_checkpoints(out)  # one checkpoint, of the step every rank stopped after
    assert 2 <= step < STEPS and checkpoint_problem(checkpoint) is None
    assert {f"rng_state_{r}.pth" for r in RANKS} <= set(read_manifest(checkpoint)["files"])

    ddp = {"distributed_type": "MULTI_GPU", "deepspeed_config": None}  # DDP, as submission 1 trained
    config = cpu_form(ROOT / "accelerate_configs" / "zero3_multinode.yaml", tmp_path / "ddp_2x2.yaml", **ddp)
    accelerate = {"LAUNCHER": "accelerate", "ACCELERATE_CONFIG": str(config)}
    second = _submit(cluster, spec, tmp_path / "batch2.log", restart=1, env=accelerate)
    try:
        assert second.wait(400) == 0, (tmp_path / "batch2.log").read_text() + cluster.logs("srun")
    finally:
        kill_tree(second.pid)
    resumed = job.records("slurm")
    assert {r["resumed_from"] for r in resumed} == {str(checkpoint)} and {r["global_step"] for r in resumed} == {STEPS}
    assert (tmp_path / "slurm.log").read_text() == "requeue 4242\n"  # not requeued again
    _assert_same_parameters(torch.load(job.results / "slurm.pt")["params"], dp1_reference["params"])
