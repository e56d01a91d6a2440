"""Sequence-parallel groups: which ranks hold one packed row together, and what a run may combine with them.

``sequence_parallel_size = S`` splits the ``W`` ranks into ``W / S`` groups of ``S`` consecutive ranks (ranks
``g * S .. g * S + S - 1``: on one node where ``S`` divides the GPUs per node, so the all-to-alls stay on NVLink).
The ranks of a group get the same micro-batches (the sampler's data-parallel rank is the group index) and each
computes a slice of every row (:mod:`pair_dpo_trainer.modeling.sequence_parallel`). Gradients are still averaged
over all ``W`` ranks by DDP or DeepSpeed, which is what the step's loss scale expects: a rank's gradient is its
slice's share of its group's pairs, and the ``S`` shares of a group add up to the group's whole gradient.

Details: parallel/README.md, "Module notes", ``sequence.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from pair_dpo_trainer.errors import Problem
from pair_dpo_trainer.modeling.sequence_parallel import SequenceParallel, enable_sequence_parallel

_GROUPS: dict[int, Any] = {}
"""Group size -> this process's group (every rank creates every group once, in the same order)."""


def sequence_parallel_group(size: int) -> Any:
    """This rank's group of ``size`` consecutive ranks, created on first use (a collective: every rank calls it).

    Raises:
        RuntimeError: without an initialised process group (the run-time checks refuse that first).
    """
    group = _GROUPS.get(size)
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("sequence parallelism needs an initialised torch.distributed process group")
        group, _ = dist.new_subgroups(group_size=size)
        _GROUPS[size] = group
    return group


def apply_sequence_parallel(model: torch.nn.Module, size: int) -> SequenceParallel | None:
    """Puts ``model`` (policy or reference) in this rank's group of ``size`` (nothing for ``size == 1``).

    Raises:
        ConfigError: ``sequence_parallel_heads`` when the model's heads do not split over ``size`` ranks.
    """
    if size <= 1:
        return None
    return enable_sequence_parallel(model, sequence_parallel_group(size), size)


def sequence_parallel_problems(
    size: int,
    *,
    world_size: int,
    fsdp: bool,
    checkpointing_mode: str,
    process_group: bool,
    step_objectives: Sequence[str] = (),
) -> list[Problem]:
    """What a run with ``sequence_parallel_size = size`` cannot do (nothing for ``size == 1``).

    ``sequence_parallel_world`` when the ranks do not split into groups of ``size``; ``sequence_parallel_unsupported``
    under FSDP2 (DDP and DeepSpeed ZeRO run it), with ``activation_checkpointing_mode='auto'`` (its measurement
    runs one rank's forward alone) and with ``step_objectives``, the objectives that read quantities of the whole
    step (SFT / ORPO token means, BCO's running mean, AOT's sort: their collectives count every rank's pairs, and
    the ranks of a group hold the same pairs).
    """
    if size <= 1:
        return []
    problems: list[Problem] = []
    if not process_group or world_size % size:
        problems.append(
            (
                "sequence_parallel_world",
                f"sequence_parallel_size={size} needs a world of a multiple of {size} processes, got "
                f"{world_size}: launch {size} x N processes (torchrun --nproc_per_node, accelerate launch "
                "--num_processes) or lower sequence_parallel_size.",
            )
        )
    if fsdp:
        problems.append(
            (
                "sequence_parallel_unsupported",
                "sequence_parallel_size > 1 runs under DDP and DeepSpeed ZeRO, not FSDP2: use a DeepSpeed config "
                "(accelerate_configs/zero3_sequence_parallel.yaml) or set sequence_parallel_size=1.",
            )
        )
    if step_objectives:
        problems.append(
            (
                "sequence_parallel_unsupported",
                f"loss_type {list(step_objectives)} read quantities of the whole optimizer step, gathered over every "
                "rank, while the ranks of a sequence-parallel group hold the same pairs: use objectives without step "
                "quantities (sigmoid, ipo, hinge, ...) or set sequence_parallel_size=1.",
            )
        )
    if checkpointing_mode == "auto":
        problems.append(
            (
                "sequence_parallel_unsupported",
                "activation_checkpointing_mode='auto' measures one rank's forward alone, which a sequence-parallel "
                "model cannot run: choose the mode yourself ('off', 'selective', 'layers:K', 'full').",
            )
        )
    return problems
