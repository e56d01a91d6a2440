"""Two nodes x two processes on one host (tests/multinode.py): what is done once per node, the output-dir lock across
nodes, checkpoints on a shared output_dir, node-local output dirs refused, and DP=4 over two nodes equal to DP=1.

Each launch serves several tests: ``ddp`` (two ``torchrun`` launchers, c10d rendezvous) trains, meets a second job
from each node while it holds the lock, then tries a node-local output_dir and ``save_on_each_node``; ``zero3`` and
``fsdp2`` (two ``accelerate launch --machine_rank`` launchers with the CPU form of the shipped multi-node configs)
train, save sharded checkpoints and resume from one in the same processes. The DP=1 reference runs in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pair_dpo_trainer.fault_tolerance.checkpoint import checkpoint_problem, list_checkpoints, read_manifest
from pair_dpo_trainer.fault_tolerance.lock import LOCK_FILENAME
from tests.multinode import NODES, ROOT, STEPS, WORKER, Cluster, Job, accelerate, cpu_form, wait
from tests.ports import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
CONFIGS = ROOT / "accelerate_configs"
RANKS = range(4)


# ---------------------------------------------------------------------------------------------- launches
@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Cluster:
    return Cluster(tmp_path_factory.mktemp("nodes"))


def _second_job(cluster: Cluster, node: int, out: str):
    """A one-process job started on ``node`` for ``out`` (it records why it stopped)."""
    spec = cluster.root / f"second_node{node}.json"
    run = {"name": f"second_node{node}", "out": out, "max_steps": 2, "keep_going": True}
    spec.write_text(json.dumps({"results": str(cluster.root / "results"), "runs": [run]}))
    return cluster.start(node, [sys.executable, str(WORKER), str(spec)], name=f"second_node{node}")


@pytest.fixture(scope="module")
def ddp(cluster) -> Job:
    shared = cluster.root / "shared"  # the shared filesystem: one directory, the same path on both nodes
    go = cluster.root / "go"
    runs = [
        {"name": "main", "out": str(shared / "main"), "max_steps": STEPS, "save_steps": 2, "hold_until": str(go)},
        {"name": "node_local", "out": "$PAIR_DPO_NODE_DISK/out", "max_steps": 2, "keep_going": True},
        {"name": "each_node", "out": str(shared / "each_node"), "max_steps": 2, "keep_going": True},
    ]
    runs[2]["options"] = {"save_on_each_node": True}
    job = Job(cluster, "ddp", runs).start("torchrun")
    try:
        job.wait_for_step("main", 1, timeout=300)  # holds the lock, waiting for `go`
        seconds = [_second_job(cluster, node, runs[0]["out"]) for node in range(NODES)]
        codes = wait(seconds, 300)
        assert codes == [0, 0], "\n".join(cluster.log(f"second_node{n}", n)[-3000:] for n in range(NODES))
        go.touch()
        assert job.finish(400) == [0, 0], cluster.logs("ddp")
    finally:
        job.kill()
    return job


@pytest.fixture(scope="module")
def zero3(tmp_path_factory) -> Job:
    return _sharded_job(Cluster(tmp_path_factory.mktemp("zero3_nodes")), "zero3", "zero3_multinode.yaml")


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory) -> Job:
    return _sharded_job(Cluster(tmp_path_factory.mktemp("fsdp2_nodes")), "fsdp2", "fsdp2_multinode.yaml")


def _sharded_job(cluster: Cluster, name: str, shipped: str) -> Job:
    """Its own cluster (fresh node-local caches): each node tokenises and hashes for this job."""
    config = cpu_form(CONFIGS / shipped, cluster.root / f"{name}_2x2.yaml")
    out = str(cluster.root / "shared" / name)
    runs = [
        {"name": name, "out": out, "max_steps": STEPS, "save_steps": 2},
        {"name": f"{name}_resumed", "out": out, "max_steps": STEPS, "save_steps": 2, "resume": f"{out}/checkpoint-4"},
    ]
    job = Job(cluster, name, runs).start("accelerate", config=config)
    assert job.finish(500) == [0, 0], cluster.logs(name)
    return job


# ---------------------------------------------------------------------------------------------- one job, two nodes
def _assert_two_nodes(job: Job, run: str, cluster: Cluster) -> list[dict]:
    records = job.records(run)
    where = [r["where"] for r in records]
    assert [w["world_size"] for w in where] == [4] * 4
    assert [(w["group_rank"], w["local_rank"]) for w in where] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    nodes = [w["disk"]["node"] for w in where]  # whose local disk each rank sees at its node-local path
    assert sorted(nodes) == [0, 0, 1, 1] and nodes[0] == nodes[1] != nodes[2] == nodes[3]
    if cluster.isolated:
        assert len({w["host"] for w in where}) == 2
    return records


def test_two_torchrun_launchers_form_one_job_of_four_ranks(ddp, cluster):
    records = _assert_two_nodes(ddp, "main", cluster)
    assert {r["global_step"] for r in records} == {STEPS}
    assert len({json.dumps(r["losses"]) for r in records}) == 1


def test_each_node_tokenises_once_and_both_nodes_train_on_the_same_bytes(ddp, cluster):
    """2 builds (one per node's local main, in its own node-local cache), not 1 or 4; the Arrow files are equal."""
    records = _assert_two_nodes(ddp, "main", cluster)
    assert [r["tokenize_pair_calls"] for r in records] == [64, 0, 64, 0]
    for main, other in ((0, 1), (2, 3)):
        assert records[main]["pairs_created_by"]["pid"] == records[main]["where"]["pid"]
        assert records[other]["pairs_created_by"] == records[main]["pairs_created_by"]
    assert len({r["pairs_sha256"] for r in records}) == 1
    assert [len(list(cluster.disk(n).rglob("pairs-*/pairs.arrow"))) for n in range(NODES)] == [1, 1]
    if cluster.isolated:  # one path, two disks
        assert len({r["pairs_file"] for r in records}) == 1


def test_each_node_logs_its_own_line_and_rank_0_the_run_summary(ddp, cluster):
    records = ddp.records("main")
    for node in range(NODES):  # the launcher of node N (c10d numbers the nodes by its own order)
        first, last = [r for r in RANKS if records[r]["where"]["disk"]["node"] == node]
        log = cluster.log("ddp", node)
        lines = [line for line in log.splitlines() if line.startswith("pair_dpo: node ")]
        host, pairs = records[first]["where"]["host"], records[first]["pairs_file"]
        assert lines == [f"pair_dpo: node {host} (ranks {first}-{last}) | train pairs tokenised here: {pairs} | "
                         f"reference snapshot: {records[0]['snapshot_files']} files hashed here"], lines  # fmt: skip
        assert log.count("pair_dpo: world_size=4 | 8 pairs/step (2 per rank in 1 micro-batch)") == (first == 0)


def test_each_node_hashes_the_reference_snapshot_once(ddp):
    records = ddp.records("main")
    assert [r["files_hashed"] for r in records] == [records[0]["snapshot_files"], 0] * 2
    assert records[0]["snapshot_files"] > 3 and len({r["manifest_digest"] for r in records}) == 1


def test_the_lock_refuses_a_second_job_from_either_node_but_not_the_job_s_own_nodes(ddp, cluster):
    main = ddp.records("main")
    holder = main[0]["where"]
    for node in range(NODES):
        second = ddp.record(f"second_node{node}", 0)
        assert second["reason_code"] == "output_dir_in_use", second
        assert f"host {holder['host']}, pid {holder['pid']}" in second["message"]
        if cluster.isolated:
            # both simulated nodes share one kernel, so the holder's flock is busy from either (on separate hosts over
            # a network filesystem node1 would instead say it cannot prove the holder dead)
            same_host = "so that run is alive"
            assert same_host in second["message"]
    assert {r["global_step"] for r in main} == {STEPS}  # the job's own node 1 was never refused
    assert not (cluster.root / "shared" / "main" / LOCK_FILENAME).exists()


def test_checkpoints_on_the_shared_output_dir_hold_every_rank_s_part(ddp, cluster):
    out = cluster.root / "shared" / "main"
    assert [step for step, _ in list_checkpoints(out)] == [2, 4, 6]
    for _, checkpoint in list_checkpoints(out):
        manifest = read_manifest(checkpoint)
        assert checkpoint_problem(checkpoint) is None and manifest["world_size"] == 4
        assert {f"rng_state_{r}.pth" for r in RANKS} <= set(manifest["files"])
    assert not (out / ".pair_dpo_staging").exists()


def test_dp4_over_two_nodes_equals_dp1_in_losses_and_gradients(ddp, dp1_reference):
    result = torch.load(ddp.results / "main.pt")
    scale = max(float(g.abs().max()) for g in dp1_reference["grads"].values())
    assert set(result["grads"]) == set(dp1_reference["grads"]) and scale > 0
    worst = max(float((result["grads"][n] - g).abs().max()) for n, g in dp1_reference["grads"].items()) / scale
    assert worst < 1e-6, worst
    assert result["losses"] == pytest.approx(dp1_reference["losses"], abs=1e-5)
    for name, param in dp1_reference["params"].items():
        torch.testing.assert_close(result["params"][name], param, atol=1e-5, rtol=0, msg=name)


def test_node_local_output_dirs_are_refused_at_start_on_every_rank(ddp, cluster):
    records = ddp.records("node_local")
    assert {r["reason_code"] for r in records} == {"output_dir_not_shared"}, records[0]
    assert "host " + records[2]["where"]["host"] in records[0]["message"]
    for node in range(NODES):  # nothing trained, no half checkpoint on either disk
        assert list_checkpoints(cluster.disk(node) / "out") == []
        assert not (cluster.disk(node) / "out" / ".pair_dpo_staging").exists()


def test_save_on_each_node_on_two_nodes_is_refused(ddp, cluster):
    records = ddp.records("each_node")
    assert {r["reason_code"] for r in records} == {"unsupported_combination"}, records[0]
    assert "save_on_each_node=True on 2 nodes" in records[0]["message"]
    assert list_checkpoints(cluster.root / "shared" / "each_node") == []


# ---------------------------------------------------------------------------------------------- accelerate, shards
@pytest.mark.parametrize(
    "engine,shards",
    [
        ("zero3", [f"global_step{{step}}/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in RANKS]),
        ("fsdp2", [f"{part}_0/__{r}_0.distcp" for part in ("pytorch_model_fsdp", "optimizer") for r in RANKS]),
    ],
)
def test_accelerate_machine_rank_with_the_shipped_multinode_config_trains_saves_and_resumes(
    request, dp1_reference, engine, shards
):
    """The shipped multi-node config in its CPU form, launched per node with --machine_rank: once-per-node work as
    under torchrun, the losses of DP=1, every rank's shards in each published checkpoint, and a resume from
    checkpoint-4 that ends where the uninterrupted run ended."""
    job = request.getfixturevalue(engine)
    cluster = job.cluster
    records = _assert_two_nodes(job, engine, cluster)
    assert [r["tokenize_pair_calls"] for r in records] == [64, 0, 64, 0]
    assert [r["files_hashed"] for r in records] == [records[0]["snapshot_files"], 0] * 2
    assert records[0]["losses"] == pytest.approx(dp1_reference["losses"], abs=1e-4)
    out = cluster.root / "shared" / engine
    assert [step for step, _ in list_checkpoints(out)] == [2, 4, 6]
    for step, checkpoint in list_checkpoints(out):
        files = set(read_manifest(checkpoint)["files"])
        assert checkpoint_problem(checkpoint) is None
        assert {shard.format(step=step) for shard in shards} | {f"rng_state_{r}.pth" for r in RANKS} <= files
    resumed = job.records(f"{engine}_resumed")
    assert {r["resumed_from"] for r in resumed} == {str(out / "checkpoint-4")}
    straight, again = torch.load(job.results / f"{engine}.pt"), torch.load(job.results / f"{engine}_resumed.pt")
    for name, param in straight["params"].items():
        torch.testing.assert_close(again["params"][name], param, atol=1e-6, rtol=0, msg=name)


# ---------------------------------------------------------------------------------------------- refused launches
def test_accelerate_multi_cpu_on_two_machines_is_refused_on_each_node(cluster):
    """accelerate's MULTI_CPU type starts ONE process per machine and ignores --machine_rank: each node would train
    alone on the shared output_dir. Both refuse before loading anything."""
    config = cpu_form(
        CONFIGS / "zero3_multinode.yaml",
        cluster.root / "multi_cpu.yaml",
        distributed_type="MULTI_CPU",
        deepspeed_config=None,
    )
    port, out = free_port(), str(cluster.root / "shared" / "multi_cpu")
    train = [str(ROOT / "train.py"), "--output_dir", out, "--max_steps", "1"]
    procs = [cluster.start(n, [*accelerate(cluster, n, port, config), *train], name="multi_cpu") for n in range(NODES)]
    codes = wait(procs, 300)
    logs = [cluster.log("multi_cpu", n) for n in range(NODES)]
    assert codes == [1, 1], "\n".join(logs)
    for log in logs:
        # accelerate's launcher re-prints the child's captured stderr when it fails, so the line may appear twice.
        assert "[launch_not_one_job] accelerate launched ONE process" in log, log
    assert not Path(out).exists()


# ------------------------------------------------------------------------------------- lock across PID namespaces
_HOLD = """
import sys, time
from pair_dpo_trainer.fault_tolerance.lock import acquire_output_dir
acquire_output_dir(sys.argv[1])
print("held", flush=True)
time.sleep(120)
"""


def test_a_live_holder_in_another_pid_namespace_with_the_same_host_name_is_not_taken_over(tmp_path):
    """Nodes that share a host name but not a PID namespace (containers with the host's UTS namespace, e.g.
    Kubernetes pods with hostNetwork, or two machines named alike): a second job must be refused, as from any host
    whose processes this one cannot see."""
    from pair_dpo_trainer.errors import RunError
    from pair_dpo_trainer.fault_tolerance.lock import OutputDirLock

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable, "-c", _HOLD, str(tmp_path)]
    try:
        holder = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError:
        pytest.skip("no unshare here")
    try:
        if holder.stdout.readline().strip() != "held":
            pytest.skip("this machine does not allow PID namespaces")
        with pytest.raises(RunError) as refused:
            OutputDirLock(tmp_path).acquire()
        assert refused.value.reason_code == "output_dir_in_use"
    finally:
        holder.kill()
        holder.wait(30)
