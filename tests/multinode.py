"""Two simulated nodes x two processes on one host: one launcher per node, each with its own local disk.

A node here is what a cluster node is to the trainer: a launcher (``torchrun --nnodes 2`` with a c10d rendezvous, or
``accelerate launch --machine_rank N``) that starts its node's ranks, a host name, and a local disk holding the HF
caches, the tokenised-pairs cache and ``TMPDIR``. Where the machine allows it (root, ``unshare``), each launcher runs in
its own mount and UTS namespace: host name ``node<N>``, an ``/etc/hosts`` that maps ``node<N>`` to ``127.0.0.<N+2>``
(the network namespace is shared: the ranks talk over loopback), and its disk bind-mounted at one path, ``LOCAL``, so
both nodes see the same path with different contents, as two machines would. Elsewhere (no namespaces) the nodes
share the host name and each gets its disk at its own path: the counts per node still hold (each node's launcher and
ranks read only their own disk), and a node-local output_dir is one each node names by its own disk
(``$PAIR_DPO_NODE_DISK/out``), but one path holding different contents on two nodes is not simulated.

``--nnodes 2`` with a c10d rendezvous numbers the nodes by its own order (torch sorts the participants), not by
``--node_rank``: a rank's node is its ``GROUP_RANK``, recorded by the worker with the disk it saw.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.ports import free_port
from tests.timing import scaled

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "multinode_worker.py"
NODES = 2
PROCS_PER_NODE = 2


@functools.cache
def namespaces_available() -> bool:
    """True when this process may create mount + UTS namespaces and bind-mount in them (root with CAP_SYS_ADMIN);
    ``PAIR_DPO_TESTS_NO_NAMESPACES=1`` runs the fallback anyway."""
    if os.environ.get("PAIR_DPO_TESTS_NO_NAMESPACES") == "1":
        return False
    try:
        probe = subprocess.run(
            ["unshare", "--mount", "--uts", "--propagation", "private", "--", "sh", "-c",
             "mount -t tmpfs probe /mnt && hostname probe"],
            capture_output=True, timeout=20,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


@dataclass
class Cluster:
    """Two nodes' disks and host names under ``root``; launches their launchers.

    Attributes:
        root: A fresh directory for this cluster (disks, hosts file, logs, specs).
        isolated: Nodes run in their own mount + UTS namespaces (default: when the machine allows it).
    """

    root: Path
    isolated: bool = field(default_factory=namespaces_available)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "logs").mkdir(exist_ok=True)
        self.local = self.root / "local"  # the shared path of each node's disk (an empty mount point on the host)
        self.local.mkdir(exist_ok=True)
        for node in range(NODES):
            disk = self.disk(node)
            for sub in ("hf_home", "hf_datasets", "tmp"):
                (disk / sub).mkdir(parents=True, exist_ok=True)
            (disk / "node.json").write_text(json.dumps({"node": node, "host": self.host(node)}))
        hosts = Path("/etc/hosts").read_text() if Path("/etc/hosts").exists() else ""
        lines = "".join(f"127.0.0.{node + 2} {self.host(node)}\n" for node in range(NODES))
        (self.root / "hosts").write_text(hosts.rstrip("\n") + "\n" + lines)

    def disk(self, node: int) -> Path:
        """Node ``node``'s local disk, as the host (the test) sees it."""
        return self.root / "disks" / f"node{node}"

    def host(self, node: int) -> str:
        """Node ``node``'s host name (the host's own when the nodes are not isolated)."""
        import socket

        return f"node{node}" if self.isolated else socket.gethostname()

    def node_local(self, node: int) -> Path:
        """The path at which node ``node``'s processes see their disk."""
        return self.local if self.isolated else self.disk(node)

    @property
    def master(self) -> str:
        """The address of node 0 as the other node reaches it."""
        return self.host(0) if self.isolated else "127.0.0.1"

    def env(self, node: int, extra: dict[str, str] | None = None) -> dict[str, str]:
        local = self.node_local(node)
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "",
            "DS_ACCELERATOR": "cpu",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": str(ROOT),
            "PYTHONDONTWRITEBYTECODE": "1",
            "TORCH_EXTENSIONS_DIR": os.environ.get(
                "TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "pair_dpo_torch_extensions")
            ),
            "HF_HOME": str(local / "hf_home"),
            "HF_DATASETS_CACHE": str(local / "hf_datasets"),
            "TMPDIR": str(local / "tmp"),
            "PAIR_DPO_NODE_DISK": str(local),
        }
        return {**env, **(extra or {})}

    def wrap(self, node: int, command: Sequence[str]) -> list[str]:
        """``command`` run as node ``node``: in its namespaces with its disk mounted, or as it is."""
        if not self.isolated:
            return list(command)
        setup = (
            f"mount --bind {self.disk(node)} {self.local} && mount --bind {self.root / 'hosts'} /etc/hosts && "
            f'hostname {self.host(node)} && exec "$@"'
        )
        return ["unshare", "--mount", "--uts", "--propagation", "private", "--", "bash", "-c", setup, "node", *command]

    def start(self, node: int, command: Sequence[str], *, name: str, env: dict[str, str] | None = None):
        """Starts node ``node``'s launcher (its own session, its log in ``logs/<name>.node<N>.log``)."""
        log = open(self.root / "logs" / f"{name}.node{node}.log", "w")  # noqa: SIM115 - closed with the process
        return subprocess.Popen(
            self.wrap(node, command), env=self.env(node, env), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def log(self, name: str, node: int) -> str:
        return (self.root / "logs" / f"{name}.node{node}.log").read_text()

    def logs(self, name: str) -> str:
        return "\n".join(f"--- node{n}\n{self.log(name, n)[-5000:]}" for n in range(NODES))


def torchrun(cluster: Cluster, node: int, port: int, *, run_id: str, extra: Sequence[str] = ()) -> list[str]:
    """Node ``node``'s ``torchrun --nnodes 2 --nproc_per_node 2`` with a c10d rendezvous at node 0."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES)]
    command += ["--nproc_per_node", str(PROCS_PER_NODE), "--rdzv_backend", "c10d", "--rdzv_id", run_id]
    command += ["--rdzv_endpoint", f"{cluster.master}:{port}"]
    if not cluster.isolated:  # one host name: only node 0 may host the rendezvous store (torch would guess both)
        command += ["--rdzv_conf", f"is_host={1 if node == 0 else 0}"]
    return [*command, *extra]


def accelerate(cluster: Cluster, node: int, port: int, config: Path) -> list[str]:
    """Node ``node``'s ``accelerate launch --config_file config --machine_rank node`` (node 0's address and port)."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    command += ["--machine_rank", str(node), "--main_process_ip", cluster.master]
    return [*command, "--main_process_port", str(port)]


def cpu_form(src: Path, dst: Path, **overrides: Any) -> Path:
    """The 2-node x 2-process CPU form of a multi-node accelerate config: only the machine counts, the CPU and the
    precision change (and ``overrides``)."""
    import yaml

    data = yaml.safe_load(src.read_text())
    data.update(num_machines=NODES, num_processes=NODES * PROCS_PER_NODE, use_cpu=True, mixed_precision="no")
    data.update(overrides)
    dst.write_text(yaml.safe_dump(data, sort_keys=False))
    return dst


@dataclass
class Job:
    """One 2-node launch of the worker: its spec, its launchers, and the ranks' records."""

    cluster: Cluster
    name: str
    runs: list[dict[str, Any]]
    launchers: list[subprocess.Popen] = field(default_factory=list)

    @property
    def results(self) -> Path:
        return self.cluster.root / "results"

    def spec_file(self) -> Path:
        self.results.mkdir(exist_ok=True)
        path = self.cluster.root / f"{self.name}.json"
        path.write_text(json.dumps({"results": str(self.results), "runs": self.runs}))
        return path

    def start(self, launcher: str = "torchrun", *, config: Path | None = None, extra: Sequence[str] = (),
              env: dict[str, str] | None = None) -> Job:  # fmt: skip
        spec = self.spec_file()
        port = free_port()
        for node in range(NODES):
            if launcher == "torchrun":
                command = torchrun(self.cluster, node, port, run_id=self.name, extra=extra)
            else:
                assert config is not None
                command = accelerate(self.cluster, node, port, config)
            command = [*command, str(WORKER), str(spec)]
            self.launchers.append(self.cluster.start(node, command, name=self.name, env=env))
        return self

    def wait(self, timeout: float) -> list[int | None]:
        """The launchers' exit codes after at most ``timeout`` seconds (None: still running)."""
        return wait(self.launchers, timeout)

    def finish(self, timeout: float = 500) -> list[int]:
        """Waits for both launchers; kills everything left after ``timeout``; asserts they exited."""
        try:
            codes = self.wait(timeout)
        finally:
            self.kill()
        assert None not in codes, f"{self.name}: still running after {timeout} s\n" + self.cluster.logs(self.name)
        return codes  # type: ignore[return-value]

    def kill(self) -> None:
        """SIGKILLs every launcher still running and all their descendants (ranks are in their own sessions)."""
        for proc in self.launchers:
            kill_tree(proc.pid)
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)

    def ranks(self, node: int) -> list[int]:
        """The pids of node ``node``'s ranks (its launcher's children)."""
        return children(self.launchers[node].pid)

    def record(self, run: str, rank: int) -> dict[str, Any]:
        path = self.results / f"{run}.rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no record of {run}\n" + self.cluster.logs(self.name)
        return json.loads(path.read_text())

    def records(self, run: str) -> list[dict[str, Any]]:
        return [self.record(run, rank) for rank in range(NODES * PROCS_PER_NODE)]

    def progress(self, run: str) -> list[tuple[int, int, float]]:
        path = self.results / f"{run}.progress"
        if not path.exists():
            return []
        lines = [line.split() for line in path.read_text().splitlines()]
        return [(int(r), int(s), float(t)) for r, s, t in (line for line in lines if len(line) == 3)]

    def wait_for_step(self, run: str, step: int, timeout: float, rank: int = 0) -> None:
        deadline = time.monotonic() + scaled(timeout)
        while time.monotonic() < deadline:
            if any(r == rank and s >= step for r, s, _ in self.progress(run)):
                return
            if all(proc.poll() is not None for proc in self.launchers):
                break
            time.sleep(0.05)
        raise AssertionError(f"{run}: rank {rank} never reported step {step}\n" + self.cluster.logs(self.name))


def wait(procs: Sequence[subprocess.Popen], timeout: float) -> list[int | None]:
    deadline = time.monotonic() + scaled(timeout)
    for proc in procs:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
    return [proc.poll() for proc in procs]


def _parents() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def children(pid: int) -> list[int]:
    return sorted(_parents().get(pid, []))


def descendants(pid: int) -> list[int]:
    kids, found, todo = _parents(), [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def signal_tree(pid: int, sig: int) -> None:
    """Sends ``sig`` to ``pid`` and every descendant (what Slurm's step cleanup or a lost machine does to a node)."""
    for target in [pid, *descendants(pid)]:
        try:
            os.kill(target, sig)
        except ProcessLookupError:
            pass


def kill_tree(pid: int) -> None:
    tree = [pid, *descendants(pid)]
    for target in tree:
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass


def expand_hostlist(hostlist: str) -> list[str]:
    """A Slurm host list (``node[0-1]``, ``gpu[01-03],login7``) as host names, in order."""
    import re

    parts, depth, current = [], 0, ""
    for char in hostlist:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts += [current] if current else []
    hosts = []
    for part in parts:
        match = re.fullmatch(r"(.*?)\[([^\]]+)\](.*)", part)
        if match is None:
            hosts.append(part)
            continue
        head, ranges, tail = match.groups()
        for item in ranges.split(","):
            first, _, last = item.partition("-")
            for number in range(int(first), int(last or first) + 1):
                hosts.append(f"{head}{str(number).zfill(len(first))}{tail}")
    return hosts


def nodelist(cluster: Cluster) -> str:
    """The cluster as Slurm's ``SLURM_JOB_NODELIST`` names it."""
    return "node[0-1]" if cluster.isolated else ",".join(cluster.host(n) for n in range(NODES))


STEPS = 6
"""Optimizer steps of every 2-node training run and of the one-process reference they are compared with."""


def train_dp1(root: Path) -> dict[str, Any]:
    """The one-process run (DP=1, 2 micro-batches of 4 pairs: the 8 pairs per step of DP=4 x 2 pairs) of the
    2-node tests: first-step gradients, losses and final parameters."""
    from tests.multinode_worker import Hooks, build

    run = {"name": "dp1", "out": str(root / "out"), "ga": 2, "max_steps": STEPS, "save_steps": 10 * STEPS}
    run["options"] = {"dataset_cache_dir": str(root / "pairs_cache")}
    trainer = build(run, world_size=1)
    hooks = Hooks(run, root / "dp1.progress")
    trainer.add_callback(hooks)
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"grads": hooks.grads, "params": params, "losses": losses}
