"""A run on several nodes needs one ``output_dir`` that every node sees: checked at start, through the lock file.

Every rank writes its part of each checkpoint (its RNG state; its ZeRO-3 or FSDP2 shards) into
``<output_dir>/.pair_dpo_staging`` and rank 0 alone lists them in the manifest and publishes the directory. On disks
local to each node the other nodes' parts never reach rank 0's checkpoint: each node would keep half a checkpoint and
the run would carry on as if nothing were wrong. So right after rank 0 took the output-dir lock, each node's local
main looks for that lock record (its random token) under its own path of ``output_dir``; a node that does not see it
stops the run on every rank (``output_dir_not_shared``). A new file can take a moment to appear on another client of
a network filesystem, so a node that does not see it looks again for :data:`VISIBILITY_SECONDS`.

``save_on_each_node`` (each node's local main saves a checkpoint of its own) is refused on more than one node: on a
shared ``output_dir`` both would publish the same ``checkpoint-N``, and on node-local disks each copy would lack the
other nodes' shards and ``.metadata`` files.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from pair_dpo_trainer.errors import ConfigError, PairDPOError, RunError
from pair_dpo_trainer.fault_tolerance.lock import LOCK_FILENAME, read_holder
from pair_dpo_trainer.parallel.agreement import all_gather_cpu

VISIBILITY_SECONDS = 10.0
"""How long a node keeps looking for rank 0's lock record before the run is refused."""
_POLL_SECONDS = 0.5


@dataclass(frozen=True)
class NodeView:
    """What one rank reports: its node, host, whether it is the node's local main, and the token it sees."""

    node_id: int
    host: str
    local_main: bool
    token: str | None


def lock_token(output_dir: str | os.PathLike[str]) -> str | None:
    """The token of the lock record this process sees in ``output_dir`` (None: no readable record)."""
    try:
        holder = read_holder(Path(output_dir) / LOCK_FILENAME)
    except PairDPOError:
        return None
    return None if holder is None else holder.token


def check_output_dir_shared(
    output_dir: str, *, node_id: int, local_main: bool, save_on_each_node: bool, deadline_s: float = VISIBILITY_SECONDS
) -> list[NodeView]:
    """Refuses a multi-node run whose nodes do not share ``output_dir`` (module docstring). A collective: every rank
    calls it, after rank 0 holds the lock.

    Args:
        output_dir: The run's output directory, as this process names it.
        node_id: Global rank of this node's local main process.
        local_main: This process is its node's local main.
        save_on_each_node: ``TrainingArguments.save_on_each_node``.
        deadline_s: How long a node that does not see the lock record looks again.

    Returns:
        Every rank's view (node, host), in rank order: the lost-peer messages name hosts with it.

    Raises:
        ConfigError: ``unsupported_combination`` for ``save_on_each_node`` on more than one node.
        RunError: ``output_dir_not_shared`` naming the nodes that do not see rank 0's lock record.
    """
    give_up = time.monotonic() + deadline_s
    while True:
        token = lock_token(output_dir) if local_main else None
        views = [NodeView(*view) for view in all_gather_cpu((node_id, socket.gethostname(), local_main, token))]
        if len({view.node_id for view in views}) <= 1:
            return views
        if save_on_each_node:
            raise ConfigError("unsupported_combination", _save_on_each_node_message(views))
        expected = views[0].token
        missing = [view for view in views if view.local_main and (expected is None or view.token != expected)]
        if not missing:
            return views
        if all_gather_cpu(time.monotonic() > give_up)[0]:  # rank 0's clock decides, so every rank stops together
            raise RunError("output_dir_not_shared", _not_shared_message(output_dir, views[0], missing))
        time.sleep(_POLL_SECONDS)


def _nodes(views: list[NodeView]) -> str:
    return ", ".join(f"host {view.host} (rank {view.node_id})" for view in views)


def _save_on_each_node_message(views: list[NodeView]) -> str:
    mains = [view for view in views if view.local_main]
    return (
        f"save_on_each_node=True on {len(mains)} nodes ({_nodes(mains)}): each node's local main would publish a "
        "checkpoint of its own. On a shared output_dir they write the same checkpoint-N directory; on node-local "
        "disks each copy lacks the other nodes' parts (RNG states, ZeRO-3 / FSDP2 shards and their metadata), so no "
        "node can resume. Leave save_on_each_node unset and put output_dir on a filesystem every node mounts."
    )


def _not_shared_message(output_dir: str, main: NodeView, missing: list[NodeView]) -> str:
    return (
        f"output_dir {output_dir} is not one directory shared by the job's nodes: rank 0 (host {main.host}) holds "
        f"its lock file {Path(output_dir) / LOCK_FILENAME}, but the local main process of {_nodes(missing)} does not "
        f"see it there after {VISIBILITY_SECONDS:g} s. Every rank writes its part of each checkpoint (RNG states, "
        "ZeRO-3 / FSDP2 shards) into output_dir and rank 0 publishes it, so on node-local disks each node would keep "
        "half a checkpoint that no node can resume. Put output_dir on a filesystem that every node mounts at the "
        "same path (NFS, Lustre, GPFS, a shared volume)."
    )
