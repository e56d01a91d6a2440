"""Fault tolerance of a run: one run per output directory, collective timeouts, preemption, atomic checkpoints.

- ``lock.py``: the exclusive output-dir lock (``output_dir_in_use``; a dead holder's lock is taken over).
- ``collectives.py``: ``ddp_timeout`` on every process group; ``collective_timeout`` / ``peer_lost`` messages.
- ``preemption.py``: SIGTERM -> finish the step, save, exit with :data:`PREEMPTED_EXIT_CODE`.
- ``checkpoint.py``: staged, fsynced, renamed checkpoints with a manifest; safe rotation; ``disk_full``.
- ``resume.py``: ``latest`` / ``auto`` / explicit resume; ``resume_data_mismatch``.
- ``guard.py``: :class:`RunGuard`, the trainer's one entry point to all of the above.
"""

from pair_dpo_trainer.fault_tolerance.guard import GuardOptions, RunGuard
from pair_dpo_trainer.fault_tolerance.preemption import PREEMPTED_EXIT_CODE, TrainingPreempted

__all__ = ["PREEMPTED_EXIT_CODE", "GuardOptions", "RunGuard", "TrainingPreempted"]
