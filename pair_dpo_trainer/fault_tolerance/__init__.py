"""Fault tolerance of a run: one run per output directory, collective timeouts, preemption, atomic checkpoints.

- ``lock.py``: the exclusive output-dir lock (``output_dir_in_use``; a kernel lock held for the run's life).
- ``collectives.py``: ``ddp_timeout`` on every process group; ``collective_timeout`` / ``peer_lost`` messages.
- ``preemption.py``: SIGTERM / SIGINT -> finish the step (or the final write), save, exit with
  :data:`PREEMPTED_EXIT_CODE`.
- ``launcher.py``: launchers that pass no stop signal on (accelerate's single-process launcher, ``deepspeed``).
- ``workers.py``: DataLoader workers that only their parent can stop.
- ``checkpoint.py``: staged, fsynced, renamed checkpoints with a manifest; safe rotation; ``disk_full``.
- ``checkpoint_paths.py``: the checkpoint's entries by ``lstat`` and the names loaders join to its path (DeepSpeed's
  tag, index and DCP shard names), resolved as the loaders do (``checkpoint_unsafe_path``, ``checkpoint_special_file``).
- ``checkpoint_trust.py``: before a resume loads anything, those paths, the files' SHA-256 and a static scan of the
  pickles (``checkpoint_tampered``, ``checkpoint_unsafe_pickle``); DeepSpeed is handed the scanned tag.
- ``resume.py``: ``latest`` / ``auto`` / explicit resume; ``resume_data_mismatch``.
- ``guard.py``: :class:`RunGuard`, the trainer's one entry point to all of the above.

The names below are imported on first use, so ``lock.py`` (and a process that only needs the lock) does not import
the Trainer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pair_dpo_trainer.errors import PREEMPTED_EXIT_CODE

if TYPE_CHECKING:
    from pair_dpo_trainer.fault_tolerance.guard import GuardOptions, RunGuard
    from pair_dpo_trainer.fault_tolerance.preemption import TrainingPreempted

_LAZY = {
    "GuardOptions": "pair_dpo_trainer.fault_tolerance.guard",
    "RunGuard": "pair_dpo_trainer.fault_tolerance.guard",
    "TrainingPreempted": "pair_dpo_trainer.fault_tolerance.preemption",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pair_dpo_trainer.fault_tolerance' has no attribute {name!r}")


__all__ = ["PREEMPTED_EXIT_CODE", "GuardOptions", "RunGuard", "TrainingPreempted"]
