"""Worker of the 2-node tests (tests/test_multinode*.py): one rank of a job that two launchers started.

Run as ``python tests/multinode_worker.py SPEC_FILE`` under ``torchrun`` / ``accelerate launch`` (one launcher per
simulated node, tests/multinode.py). SPEC_FILE is JSON with ``results`` (a directory) and ``runs``, trained one after
the other in this process. Each run trains the bundled tiny Llama, loaded by path with its pinned revision (so each
node's local main hashes the snapshot), on raw demo rows (so each node's local main tokenises them). A run has:

- ``name``, ``out`` (output_dir; environment variables in it are expanded on each node, e.g.
  ``$PAIR_DPO_NODE_DISK``, the node's local disk), ``max_steps``, ``save_steps``, ``resume`` (passed to ``train``),
  ``options`` (more ``PairDPOConfig`` fields), ``step_sleep`` (seconds after each step), ``hold_until`` (after step
  1, wait until that file exists), ``keep_going`` (a refused or failed run is recorded and the next run starts);
- ``fault``: ``{"kind": "die", "step": S, "rank": R}``: SIGKILL itself at the end of step S, once (a marker file
  ``<results>/<name>.died`` remembers it), so an elastic restart runs clean.

Each rank writes ``<results>/<name>.rank<R>.json`` (where it ran, what it tokenised and hashed, its losses or its
error and exit code), appends ``rank step time`` to ``<results>/<name>.progress`` after every step, and rank 0 writes
``<results>/<name>.pt`` (first-step gradients after the all-reduce, final parameters, losses).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pair_dpo_trainer import PairDPOTrainer  # noqa: E402
from pair_dpo_trainer.data import tokenize  # noqa: E402
from pair_dpo_trainer.demo import DEMO_REVISION, bundled_model_dir  # noqa: E402
from pair_dpo_trainer.demo.pairs import generate_demo_pairs  # noqa: E402
from pair_dpo_trainer.parallel.collectives import end_process_group  # noqa: E402
from tests.dpo_fixtures import cpu_config  # noqa: E402
from tests.gc_heap import freeze_import_heap  # noqa: E402

GLOBAL_PAIRS = 8
NUM_PAIRS = 64
TRAINING = {"optim": "sgd", "learning_rate": 2.0, "max_grad_norm": 1.0}
"""Plain SGD: parameters after a step differ exactly as much as the gradients did (Adam's first steps are sign-like
and turn float noise in near-zero gradients into visible parameter differences); clipping at 1.0 as the shipped
ZeRO-3 configs do."""
NODE_MARKER = "node.json"
"""Written by the harness on each node's local disk: which node's disk a rank sees at the shared path."""

CALLS = {"tokenize_pair": 0}
_tokenize_pair = tokenize.tokenize_pair


def _counting_tokenize_pair(*args, **kwargs):
    CALLS["tokenize_pair"] += 1
    return _tokenize_pair(*args, **kwargs)


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Hooks(TrainerCallback):
    """First-step gradients, progress lines, per-step sleep, the hold after step 1 and the self-kill fault."""

    def __init__(self, run: dict[str, Any], progress: Path) -> None:
        self.run, self.progress = run, progress
        self.grads: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step == 0 and model is not None:
            grads = {n: p.grad for n, p in model.named_parameters()}  # DDP: whole, averaged over the ranks
            if all(type(g) is torch.Tensor for g in grads.values()):  # not ZeRO-3 partitions / FSDP2 DTensors
                self.grads = {n: g.detach().clone() for n, g in grads.items()}

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        with open(self.progress, "a") as f:
            f.write(f"{rank()} {step} {time.time():.3f}\n")
        if self.run.get("step_sleep"):
            time.sleep(self.run["step_sleep"])
        hold = self.run.get("hold_until")
        if hold and step == 1:
            while not Path(hold).exists():
                time.sleep(0.05)
        fault = self.run.get("fault") or {}
        if fault.get("kind") == "die" and fault["step"] == step and fault["rank"] == rank():
            marker = self.progress.with_suffix(".died")
            if not marker.exists():  # once: the restarted rank trains on
                marker.write_text(f"{rank()} {step}\n")
                os.kill(os.getpid(), signal.SIGKILL)
        return control


def build(run: dict[str, Any], world_size: int | None = None) -> PairDPOTrainer:
    """The run's trainer; ``world_size`` (default: the launcher's) sets the per-rank batch of the global 8 pairs."""
    world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    ga = run.get("ga", 1)
    options = {
        "output_dir": run["out"],
        "ref_model_revision": DEMO_REVISION,
        "max_length": 128,
        "max_prompt_length": 64,
        "per_device_train_batch_size": GLOBAL_PAIRS // (world * ga),
        "gradient_accumulation_steps": ga,
        **TRAINING,
        "max_steps": run.get("max_steps", 4),
        "save_strategy": "steps",
        "save_steps": run.get("save_steps", 2),
        "ddp_timeout": run.get("ddp_timeout", 60),
        "dataset_num_proc": 1,
        "allow_unpinned_reference": False,
        **run.get("options", {}),
    }
    model = str(bundled_model_dir())
    return PairDPOTrainer(
        model=model,
        args=cpu_config(Path(run["out"]), **options),
        train_dataset=generate_demo_pairs(seed=11, n=NUM_PAIRS),
        processing_class=AutoTokenizer.from_pretrained(model),
    )


def where() -> dict[str, Any]:
    """This rank's place: ranks, node (its launcher's group rank), host, and whose local disk it sees."""
    marker = Path(os.environ.get("PAIR_DPO_NODE_DISK", "/nonexistent")) / NODE_MARKER
    return {
        "rank": rank(),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "group_rank": int(os.environ.get("GROUP_RANK", "0")),
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "attempt": attempt(),
        "disk": json.loads(marker.read_text()) if marker.exists() else None,
    }


def data_facts(trainer: PairDPOTrainer) -> dict[str, Any]:
    """What this rank tokenised and hashed, and the bytes of the pairs it trains on."""
    files = [entry["filename"] for entry in trainer.train_dataset.cache_files]
    arrow = Path(files[0])
    meta = json.loads((arrow.parent / "meta.json").read_text())
    source = trainer.reference_source
    return {
        "tokenize_pair_calls": CALLS["tokenize_pair"],
        "pairs_file": str(arrow),
        "pairs_sha256": hashlib.sha256(arrow.read_bytes()).hexdigest(),
        "pairs_created_by": meta["created_by"],
        "files_hashed": source.files_hashed,
        "snapshot_files": len(source.snapshot.files),
        "manifest_digest": source.snapshot.manifest_digest,
    }


def run_one(run: dict[str, Any], results: Path) -> bool:
    """Trains one run; records it. Returns False when it failed and the next runs should not start."""
    run = {**run, "out": os.path.expandvars(run["out"])}
    record: dict[str, Any] = {"where": where()}
    path = results / f"{run['name']}.rank{rank()}.json"
    CALLS["tokenize_pair"] = 0
    try:
        trainer = build(run)
        record.update(data_facts(trainer))
        hooks = Hooks(run, results / f"{run['name']}.progress")
        trainer.add_callback(hooks)
        trainer.train(resume_from_checkpoint=run.get("resume"))
    except SystemExit as exc:  # TrainingPreempted: exit code 75
        record.update(reason_code=getattr(exc, "reason_code", None), exit=exc.code, time=time.time())
        path.write_text(json.dumps(record))
        raise
    except Exception as exc:
        record.update(reason_code=getattr(exc, "reason_code", None), message=str(exc), type=type(exc).__name__)
        record.update(traceback=traceback.format_exc()[-3000:], time=time.time())
        path.write_text(json.dumps(record))
        if run.get("keep_going"):
            return True
        raise
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    record.update(reason_code=None, global_step=trainer.state.global_step, losses=losses, time=time.time())
    record["resumed_from"] = trainer.run_guard.resume_checkpoint
    params = full_parameters(trainer.model)  # collective under ZeRO-3: every rank gathers
    if rank() == 0:
        torch.save({"grads": hooks.grads, "params": params, "losses": losses}, results / f"{run['name']}.pt")
    path.write_text(json.dumps(record))
    return True


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from tests.ds_worker import full_parameters as gathered

    return gathered(model)


def main() -> None:
    tokenize.tokenize_pair = _counting_tokenize_pair  # the name tokenize_dataset calls, in this process only
    spec = json.loads(Path(sys.argv[1]).read_text())
    results = Path(spec["results"])
    for run in spec["runs"]:
        if not run_one(run, results):
            break
    end_process_group()  # every rank together: a live gloo group at interpreter exit can abort the process


if __name__ == "__main__":
    freeze_import_heap()  # several trainings follow, each starting with a full gc.collect()
    main()
