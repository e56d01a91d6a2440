"""``activation_checkpointing_mode="auto"``: the cheapest memory strategy that fits the token budget, measured once.

At the start of ``train()`` (the model, reference and data are ready, the optimizer is not yet) one synthetic packed
row of exactly ``max_tokens_per_microbatch`` tokens runs forward and backward through the policy and the reference
under each candidate of :data:`CANDIDATES`, cheapest first, until the measured peak plus the optimizer state still to
come fits the GPU. Every rank measures and the ranks take the most conservative choice, so they run the same layers.

The candidates recompute more and more (no checkpointing, selective, every K-th layer, every layer), then keep the
checkpointed layers' inputs in host memory (``activation_offload``), then also run each MLP in sequence tiles
(``tiled_mlp='auto'``, :mod:`pair_dpo_trainer.modeling.tiled_mlp`). ``activation_offload=True`` or a ``tiled_mlp``
set in the config stays on in every candidate.

The probe runs the layers eagerly first (an upper bound on what compiled layers save). With ``torch_compile`` the
modes cheaper than that choice are measured again once the layers are compiled (``training.layers``): inductor
recomputes cheap element-wise results instead of saving them, so a compiled layer without checkpointing can fit where
the eager one did not (an 8B model at 12,288 tokens on one H200, docs/benchmarks.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pair_dpo_trainer.modeling.checkpointing import apply_activation_checkpointing, offload_activations
from pair_dpo_trainer.modeling.tiled_mlp import apply_tiled_mlp

CANDIDATES = ("off", "selective", "layers:4", "layers:3", "layers:2", "full", "full+offload", "full+offload+tiled")
"""In order of cost: no recompute, the element-wise ops, a quarter ... half of the layers, every layer; then every
layer with the saved layer inputs in host memory (PCIe copies); then also the MLP in tiles (one more MLP forward)."""


@dataclass(frozen=True)
class Strategy:
    """What a candidate runs: the checkpointing mode, host offload, and the MLP's tiles (None: untiled)."""

    mode: str
    offload: bool = False
    tiled_mlp: int | str | None = None


def strategy(name: str, *, offload: bool = False, tiled_mlp: int | str | None = None) -> Strategy:
    """The :class:`Strategy` of a candidate name (``"full+offload+tiled"``), with the run's own ``activation_offload``
    and ``tiled_mlp`` kept on.

    Example:
        >>> strategy("full+offload+tiled")
        Strategy(mode='full', offload=True, tiled_mlp='auto')
        >>> strategy("layers:2", tiled_mlp=4096)
        Strategy(mode='layers:2', offload=False, tiled_mlp=4096)
    """
    mode, *extras = name.split("+")
    tiles = tiled_mlp if tiled_mlp is not None else ("auto" if "tiled" in extras else None)
    return Strategy(mode, offload or "offload" in extras, tiles)


def apply_strategy(model: torch.nn.Module, chosen: Strategy, reference: torch.nn.Module | None = None) -> None:
    """Marks ``model``'s layers with ``chosen`` (checkpointing, offload on or off, tiles); ``reference`` (an
    in-process reference model) gets the same tiles for its no-grad forward."""
    apply_activation_checkpointing(model, chosen.mode)
    offload_activations(model, chosen.offload)
    for target in (model, reference):
        if target is not None:
            apply_tiled_mlp(target, chosen.tiled_mlp)


MEMORY_FRACTION = 0.9
"""The share of the device memory a probe's peak may reach (the rest: workspaces, fragmentation, the first step's
temporaries)."""


class PeakMeter(Protocol):
    """Measures the peak memory of a probe and the memory it may use."""

    def reset(self) -> None: ...

    def peak(self) -> int: ...

    def limit(self) -> int: ...


class CudaPeakMeter:
    """The CUDA caching allocator's peak, against :data:`MEMORY_FRACTION` of what this process can use."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))

    def limit(self) -> int:
        free, _total = torch.cuda.mem_get_info(self.device)
        return int(MEMORY_FRACTION * (free + torch.cuda.memory_reserved(self.device)))


@dataclass(frozen=True)
class MemoryFit:
    """The choice of the auto mode, for the run summary.

    Attributes:
        mode: The chosen candidate (:data:`CANDIDATES`: a checkpointing mode, ``+offload``, ``+tiled``).
        peak_bytes: The probe's peak under it, plus the optimizer state still to come.
        limit_bytes: What the probe could use.
        fits: False when even ``full`` did not fit (the run goes on with ``full`` and may run out of memory).
        tokens: The probe row's length (the token budget).
        compiled: The peak was measured through the compiled layers (a mode the eager probe rejected).
    """

    mode: str
    peak_bytes: int
    limit_bytes: int
    fits: bool
    tokens: int
    compiled: bool = False

    def describe(self) -> str:
        """``auto -> layers:2 (peak 101.3 of 125.8 GiB at 16384 tokens)``; ``full+offload+tiled``: every layer
        checkpointed, its inputs in host memory, the MLP in tiles."""
        peak = "out of memory" if self.peak_bytes == math.inf else f"{self.peak_bytes / 2**30:.1f}"
        note = ", compiled layers" if self.compiled else ""
        note += "" if self.fits else ", does not fit: expect out-of-memory"
        return f"auto -> {self.mode} (peak {peak} of {self.limit_bytes / 2**30:.1f} GiB at {self.tokens} tokens{note})"


def _is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def choose_checkpointing(
    model: torch.nn.Module,
    probe: Callable[[], None],
    meter: PeakMeter,
    *,
    pending_bytes: int,
    tokens: int,
    candidates: Sequence[str] = CANDIDATES,
    kept: Strategy = Strategy("off"),
    reference: torch.nn.Module | None = None,
) -> MemoryFit:
    """Tries ``candidates`` in order and keeps the first whose probe peak plus ``pending_bytes`` fits the meter's
    limit; ``model`` is left marked with the choice (``reference`` with its tiles).

    Args:
        model: The policy, its layers eager or compiled (the probe measures whichever runs).
        probe: One forward and backward of the budget-sized row; must leave no gradient behind.
        meter: Where the peak and the limit come from.
        pending_bytes: Memory the run will add later (the optimizer's state before its first step).
        tokens: The probe row's length, for the summary.
        candidates: Candidate names (:data:`CANDIDATES`), cheapest first.
        kept: The run's own ``activation_offload`` / ``tiled_mlp``, on in every candidate (its ``mode`` unused).
        reference: The in-process reference model, tiled with the policy (None: none, or the policy itself).
    """
    peak: float = math.inf
    for mode in candidates:
        apply_strategy(model, strategy(mode, offload=kept.offload, tiled_mlp=kept.tiled_mlp), reference)
        meter.reset()
        try:
            probe()
            peak = meter.peak() + pending_bytes
        except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is a RuntimeError
            if not _is_out_of_memory(exc):
                raise
            peak = math.inf
        finally:
            for param in model.parameters():
                param.grad = None
        if peak <= meter.limit():
            return MemoryFit(mode, int(peak), meter.limit(), True, tokens)
    return MemoryFit(candidates[-1], peak, meter.limit(), False, tokens)  # type: ignore[arg-type]


def optimizer_state_bytes(model: torch.nn.Module) -> int:
    """AdamW's two moments of every trainable parameter, in the parameter's dtype (what it allocates at step 1)."""
    return sum(2 * p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def most_conservative(modes: Sequence[str]) -> str:
    """The mode of the ranks that recomputes the most (ranks must checkpoint the same layers)."""
    return max(modes, key=lambda mode: CANDIDATES.index(mode) if mode in CANDIDATES else len(CANDIDATES))
