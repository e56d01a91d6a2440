"""Test-only worker for tests/test_*_faults.py: trains the tiny Llama and injects one real fault.

Run as ``python tests/fault_worker.py CONFIG_JSON`` (one process), or once per rank with the ``RANK`` /
``WORLD_SIZE`` / ``MASTER_*`` environment set (what ``srun`` or torchrun give each process; the test launches the ranks
itself so that it can signal one rank and read every rank's exit code). CONFIG_JSON holds ``runs``: a list of run
specs trained one after the other in this process. Each spec has:

- ``out`` (output_dir); ``result``: each rank writes its outcome to ``<result>.rank<R>.json``, plus
  ``<result>.rank<R>.pt`` (final parameters, logged losses) when the run ends normally;
- ``max_steps``, ``save_steps``, ``save_total_limit``, ``num_pairs``, ``data_seed``, ``seed``, ``ga``,
  ``learning_rate`` (default 1e-2), ``max_nonfinite_grad_skips``, ``ddp_timeout``, ``reference_free``,
  ``deepspeed`` (a DeepSpeed config dict), ``resume`` (passed to ``train``),
  ``gpu`` (one CUDA device per rank, NCCL, when there is CUDA), ``use_cpu``;
- ``step_sleep`` (seconds per step, so a test can signal a run mid-way), ``progress`` (a file each rank appends
  ``rank step time`` to after every step), ``hold_until`` (after step 1, wait until that file exists);
- ``workers`` (``dataloader_num_workers``), ``worker_marks`` (a directory: the trainer's ``worker_init_fn`` writes
  ``<pid>`` there in each DataLoader worker, so a test sees that a user's function still runs);
- ``then_next``: a run that raises records its outcome and the process goes on to the next spec (exit code 1 at
  the end), so that one launch sees several refusals;
- ``fault`` (optional), a real signal or a real full disk:

  - ``{"kind": "save", "point": P, "signal": "KILL" | "INT", "step": S, "rank": R}``: the process signals itself
    inside the save of step S (``INT`` twice: Ctrl-C twice, which aborts without saving). P is ``optimizer``
    (``optimizer.pt`` half written), ``shard`` (this rank's ZeRO optimizer shard half written), ``identity`` (just
    before the identity file is renamed into place) or ``rotation`` (while an old checkpoint is being deleted);
  - ``{"kind": "stop", "where": "step_end" | "backward", "step": S, "rank": R}``: SIGSTOP itself at the step's end,
    or after the forward of the next step's last micro-batch;
  - ``{"kind": "die", "step": S, "rank": R}``: SIGKILL itself at the step's end;
  - ``{"kind": "fill_disk", "step": S, "free": BYTES}``: fill the output filesystem up to BYTES free after step S.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pair_dpo_trainer import PairDPOTrainer  # noqa: E402
from pair_dpo_trainer.parallel.collectives import end_process_group  # noqa: E402
from tests.dpo_fixtures import cpu_config, synthetic_pairs  # noqa: E402
from tests.models import tiny_llama, tiny_tokenizer  # noqa: E402

GLOBAL_PAIRS = 8
GA = 2


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


class StepHooks(TrainerCallback):
    """Progress lines, per-step sleep, and the step-boundary faults (stop, die, fill_disk)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.fault = spec.get("fault") or {}

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if self.spec.get("progress"):
            with open(self.spec["progress"], "a") as f:
                f.write(f"{rank()} {step} {time.time():.3f}\n")
        if self.spec.get("step_sleep"):
            time.sleep(self.spec["step_sleep"])
        hold = self.spec.get("hold_until")
        if hold and step == 1:
            while not Path(hold).exists():
                time.sleep(0.05)
        fault = self.fault
        if fault.get("step") == step and fault.get("rank", rank()) == rank():
            if fault["kind"] == "stop" and fault["where"] == "step_end":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif fault["kind"] == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault["kind"] == "fill_disk":
                fill_disk(Path(args.output_dir), fault["free"])
        return control


def fill_disk(directory: Path, leave: int) -> None:
    """Writes a filler file so that ``leave`` bytes stay free on ``directory``'s filesystem."""
    free = shutil.disk_usage(directory).free
    with open(directory / "filler.bin", "wb") as f:
        f.write(b"\0" * max(free - leave, 0))


def mark_worker(directory: str, worker_id: int) -> None:
    """A user's ``worker_init_fn``: records that it ran in this DataLoader worker."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    (Path(directory) / str(os.getpid())).write_text(str(worker_id))


def send_signal(sig: int) -> None:
    """``sig`` to this process; SIGINT twice (the first Ctrl-C asks to stop after the step, the second aborts)."""
    os.kill(os.getpid(), sig)
    if sig == signal.SIGINT:
        time.sleep(0.2)
        os.kill(os.getpid(), sig)


def install_save_fault(fault: dict[str, Any], trainer: PairDPOTrainer) -> None:
    """Patches the library functions a save goes through to send a real signal at the chosen point."""
    sig = getattr(signal, f"SIG{fault.get('signal', 'KILL')}")

    def due() -> bool:
        return trainer.state.global_step == fault["step"] and fault.get("rank", rank()) == rank()

    def hit() -> None:
        send_signal(sig)
        time.sleep(5)  # SIGINT: the KeyboardInterrupt is raised here

    point = fault["point"]
    if point in ("optimizer", "shard"):
        suffix = "optimizer.pt" if point == "optimizer" else f"zero_pp_rank_{rank()}_mp_rank_00_optim_states.pt"
        original = torch.save

        def save(obj, f, *args, **kwargs):
            if due() and str(f).endswith(suffix):
                Path(f).write_bytes(b"")  # the 0-byte file of a write cut short
                hit()
            return original(obj, f, *args, **kwargs)

        torch.save = save
    elif point == "identity":
        original_replace = os.replace

        def replace(src, dst, *args, **kwargs):
            if due() and str(dst).endswith("pair_dpo_reference.json"):
                hit()
            return original_replace(src, dst, *args, **kwargs)

        os.replace = replace
    elif point == "rotation":
        original_rmtree = shutil.rmtree

        def rmtree(path, *args, **kwargs):
            if due() and "checkpoint-" in str(path):
                files = sorted(p for p in Path(path).rglob("*") if p.is_file())
                files[0].unlink()  # half-deleted
                hit()
            return original_rmtree(path, *args, **kwargs)

        shutil.rmtree = rmtree


def install_backward_stop(fault: dict[str, Any], trainer: PairDPOTrainer) -> None:
    """SIGSTOP after the forward of the step's last micro-batch: the peer then waits in DDP's gradient all-reduce."""
    original = trainer.compute_loss
    calls = []

    def compute_loss(*args, **kwargs):
        loss = original(*args, **kwargs)
        if trainer.state.global_step == fault["step"] and rank() == fault["rank"]:
            calls.append(1)
            if len(calls) == trainer.args.gradient_accumulation_steps:
                os.kill(os.getpid(), signal.SIGSTOP)
        return loss

    trainer.compute_loss = compute_loss


def build(spec: dict[str, Any]) -> PairDPOTrainer:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ga = spec.get("ga", GA)
    options = dict(
        output_dir=spec["out"],
        max_steps=spec.get("max_steps", 8),
        per_device_train_batch_size=GLOBAL_PAIRS // (world * ga),
        gradient_accumulation_steps=ga,
        learning_rate=spec.get("learning_rate", 1e-2),
        max_grad_norm=0.0,
        save_strategy="steps",
        save_steps=spec.get("save_steps", 2),
        save_total_limit=spec.get("save_total_limit"),
        seed=spec.get("seed", 0),
        ddp_timeout=spec.get("ddp_timeout", 60),
        reference_free=spec.get("reference_free", False),
        allow_unpinned_reference=not spec.get("reference_free", False),
    )
    if "max_nonfinite_grad_skips" in spec:
        options["max_nonfinite_grad_skips"] = spec["max_nonfinite_grad_skips"]
    if spec.get("deepspeed"):
        options["deepspeed"] = spec["deepspeed"]
    if spec.get("workers"):
        options["dataloader_num_workers"] = spec["workers"]
    if spec.get("gpu") and torch.cuda.is_available():  # tests/test_nccl_faults.py: NCCL, one GPU per rank
        options.update(use_cpu=False, attn_backend="sdpa_segments")
    if "use_cpu" in spec:  # use_cpu=False on a CPU-only machine: launch.resolve_use_cpu still forms one job
        options["use_cpu"] = spec["use_cpu"]
    pairs = synthetic_pairs(spec.get("num_pairs", 64), seed=spec.get("data_seed", 0))
    trainer = PairDPOTrainer(
        model=tiny_llama(0), args=cpu_config(Path(spec["out"]), **options), train_dataset=pairs,
        processing_class=tiny_tokenizer(),
    )  # fmt: skip
    trainer.add_callback(StepHooks(spec))
    if spec.get("worker_marks"):
        trainer.worker_init_fn = functools.partial(mark_worker, spec["worker_marks"])
    fault = spec.get("fault") or {}
    if fault.get("kind") == "save":
        install_save_fault(fault, trainer)
    if fault.get("kind") == "stop" and fault["where"] == "backward":
        install_backward_stop(fault, trainer)
    return trainer


def outcome(result: str, payload: dict[str, Any]) -> None:
    Path(f"{result}.rank{rank()}.json").write_text(json.dumps({**payload, "time": time.time(), "pid": os.getpid()}))


def run(spec: dict[str, Any]) -> None:
    trainer = build(spec)
    try:
        trainer.train(resume_from_checkpoint=spec.get("resume"))
    except SystemExit as exc:
        outcome(spec["result"], {"reason_code": getattr(exc, "reason_code", None), "code": exc.code})
        raise
    except BaseException as exc:
        payload = {"reason_code": getattr(exc, "reason_code", None), "type": type(exc).__name__, "message": str(exc)}
        outcome(spec["result"], {**payload, "traceback": traceback.format_exc()[-3000:]})
        raise
    from tests.ds_worker import full_parameters

    params = full_parameters(trainer.model)
    losses = [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e]
    torch.save({"params": params, "losses": losses}, f"{spec['result']}.rank{rank()}.pt")
    outcome(spec["result"], {"reason_code": None, "global_step": trainer.state.global_step})


def main() -> None:
    config = json.loads(sys.argv[1])
    refused = False
    for spec in config["runs"]:
        try:
            run(spec)
        except Exception:
            if not spec.get("then_next"):
                raise
            refused = True  # its outcome file holds the error; the next spec runs in this process
    end_process_group()  # every rank together: a live gloo group at interpreter exit can abort the process
    if refused:
        sys.exit(1)


if __name__ == "__main__":
    main()
