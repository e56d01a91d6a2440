"""Ulysses sequence parallelism inside the model: the all-to-alls around attention and the per-sequence sums.

Under sequence parallelism the ``size`` ranks of a group hold consecutive slices of one packed row (``T / size``
tokens each: :class:`~pair_dpo_trainer.collators.packed.SequenceShard`). Everything but attention is per token, so
each rank runs the embeddings, norms, MLPs and the LM head on its own slice. Attention needs whole sequences: an
all-to-all turns each rank's ``[T / size, H, D]`` queries, keys and values into ``[T, H / size, D]`` (the whole row
for a share of the heads: DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv:2309.14509, Sec. 3.1), the row's own varlen
kernel runs with the row's boundaries (so pairs, their shared prompt and causality are exactly those of one rank),
and a second all-to-all returns ``[T / size, H, D]``. A sequence's log-prob is the sum of its tokens' log-probs over
the group (:func:`sum_over_group`).

The algorithm is DeepSpeed's (``deepspeed.sequence.layer.DistributedAttention``, ``ulysses_sp``); it is written
here around ``pair_varlen`` because the packed row's attention needs its own query/key boundaries and key gather,
and because it must run under DDP as under ZeRO-3 (torch's autograd-aware functional all-to-all, which gloo runs on
the CPU too).

Details: modeling/README.md, "Module notes", ``sequence_parallel.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from pair_dpo_trainer.errors import ConfigError, Problem
from pair_dpo_trainer.modeling.wrappers import unwrap_model

GROUP_ATTR = "_pair_sequence_parallel"
"""Attribute of every module of a sequence-parallel model: its :class:`SequenceParallel` group."""


@dataclass(frozen=True, eq=False)
class SequenceParallel:
    """One sequence-parallel group as the model sees it.

    Attributes:
        group: The process group of the ``size`` ranks that hold one row.
        size: Ranks in the group.
        kv_repeat: Copies of each key/value head made before the all-to-all (1 when the key/value heads divide
            among the ranks; ``size / Hkv`` when there are fewer key/value heads than ranks, as DeepSpeed does).
    """

    group: Any
    size: int
    kv_repeat: int = 1

    def __deepcopy__(self, memo: dict) -> SequenceParallel:
        return self  # a process group is not copied with a model (a reference built as a copy of the policy)


def head_problems(num_heads: int, num_kv_heads: int, size: int) -> list[Problem]:
    """``sequence_parallel_heads`` when the attention heads cannot be split over ``size`` ranks.

    Query heads must divide evenly; key/value heads must divide evenly or divide ``size`` (each then copied
    ``size / Hkv`` times, so every rank holds the key/value head of its query heads).
    """
    if num_heads % size == 0 and (num_kv_heads % size == 0 or size % num_kv_heads == 0):
        return []
    return [
        (
            "sequence_parallel_heads",
            f"sequence_parallel_size={size} splits the attention heads over the ranks of a group, but the model has "
            f"{num_heads} query heads and {num_kv_heads} key/value heads: the query heads must be a multiple of the "
            "size, the key/value heads a multiple or a divisor of it. Choose a sequence_parallel_size that fits.",
        )
    ]


def model_heads(model: torch.nn.Module) -> tuple[int, int]:
    """``(query heads, key/value heads)`` of a transformers decoder's config."""
    config = unwrap_model(model).config
    heads = int(config.num_attention_heads)
    return heads, int(getattr(config, "num_key_value_heads", None) or heads)


def enable_sequence_parallel(model: torch.nn.Module, group: Any, size: int) -> SequenceParallel:
    """Marks every module of ``model`` with its sequence-parallel group (read by the attention and the log-probs).

    Raises:
        ConfigError: ``sequence_parallel_heads`` (see :func:`head_problems`).
    """
    heads, kv_heads = model_heads(model)
    problems = head_problems(heads, kv_heads, size)
    if problems:
        raise ConfigError(*problems[0])
    parallel = SequenceParallel(group, size, kv_repeat=max(size // kv_heads, 1) if kv_heads % size else 1)
    for module in unwrap_model(model).modules():
        setattr(module, GROUP_ATTR, parallel)
    return parallel


def model_sequence_parallel(model: torch.nn.Module) -> SequenceParallel | None:
    """The group :func:`enable_sequence_parallel` set on ``model`` (wrappers allowed), else None."""
    return getattr(unwrap_model(model), GROUP_ATTR, None)


def module_sequence_parallel(module: torch.nn.Module) -> SequenceParallel | None:
    """The group of one (attention) module, else None."""
    return getattr(module, GROUP_ATTR, None)


def _all_to_all(x: torch.Tensor, parallel: SequenceParallel) -> torch.Tensor:
    """Chunk ``i`` of dim 0 goes to rank ``i``; chunk ``i`` of the result came from rank ``i`` (with gradient)."""
    out = funcol.all_to_all_single_autograd(x.contiguous(), None, None, parallel.group)
    return funcol.wait_tensor(out)


def gather_sequence(x: torch.Tensor, parallel: SequenceParallel, *, repeat: int = 1) -> torch.Tensor:
    """``[1, H, T / size, D]`` this rank's tokens, every head -> ``[1, H * repeat / size, T, D]`` every token, this
    rank's heads (rank ``j`` gets heads ``j * H' / size ...``; ``repeat`` copies each head first: GQA with fewer
    key/value heads than ranks)."""
    if repeat > 1:
        x = x.repeat_interleave(repeat, dim=1)
    _, heads, length, dim = x.shape
    size = parallel.size
    chunks = _all_to_all(x.reshape(size, heads // size, length, dim), parallel)  # [source rank, H/size, T_l, D]
    return chunks.transpose(0, 1).reshape(1, heads // size, size * length, dim)


def scatter_sequence(x: torch.Tensor, parallel: SequenceParallel) -> torch.Tensor:
    """``[1, T, H / size, D]`` every token, this rank's heads -> ``[1, T / size, H, D]`` this rank's tokens, every
    head (the inverse of :func:`gather_sequence` for an attention output)."""
    _, length, heads, dim = x.shape
    size = parallel.size
    chunks = _all_to_all(x.reshape(size, length // size, heads, dim), parallel)  # [head group, T_l, H/size, D]
    return chunks.permute(1, 0, 2, 3).reshape(1, length // size, size * heads, dim)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce sum in forward and in backward (a differentiable all-reduce).

    Every rank of the group computes the loss of the group's pairs from the summed values and carries ``1 / size``
    of it (the loss is normalised by the data-parallel size, see ``training.accumulation``), so the gradient of the
    group's loss with respect to one rank's partial sum is the sum of the ranks' gradients.
    """

    @staticmethod
    def forward(ctx: Any, values: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        total = values.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


def sum_over_group(values: torch.Tensor, parallel: SequenceParallel | None) -> torch.Tensor:
    """``values`` summed over the ranks of ``parallel`` (unchanged without it); see :class:`_SumOverGroup`."""
    if parallel is None:
        return values
    return _SumOverGroup.apply(values, parallel.group)
