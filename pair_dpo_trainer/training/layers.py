"""What runs inside the decoder layers, set up once at the start of ``train()`` / ``evaluate()``, in the only order
that works: float8 conversion (policy and an in-process reference), then activation checkpointing of the policy
(``auto`` measured here), then host offload and the MLP's tiles (policy and reference), then regional compile (and the
chunked head's element-wise work).

The reference is converted like the policy (the same float8 recipe, the same weights: at step 0 both compute the same
log-probs, so the sigmoid loss is ln 2); it is never checkpointed (it runs without gradient).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch
from transformers import TrainerCallback

from pair_dpo_trainer.collators.batch import PackedPairBatch
from pair_dpo_trainer.collators.packed import PackedPairCollator
from pair_dpo_trainer.config.sections import BatchLimits, LayerOptions
from pair_dpo_trainer.errors import Problem
from pair_dpo_trainer.modeling.chunked_head import compile_head_kernels
from pair_dpo_trainer.modeling.compile import compile_decoder_layers
from pair_dpo_trainer.modeling.float8 import convert_to_fp8, count_fp8_layers, precompute_fp8_scales
from pair_dpo_trainer.modeling.logprobs import packed_policy_logps
from pair_dpo_trainer.modeling.tiled_mlp import apply_tiled_mlp
from pair_dpo_trainer.modeling.wrappers import forward_replaced, unwrap_model
from pair_dpo_trainer.parallel.agreement import all_gather_cpu
from pair_dpo_trainer.training.memory_fit import (
    CANDIDATES,
    CudaPeakMeter,
    MemoryFit,
    Strategy,
    apply_strategy,
    choose_checkpointing,
    most_conservative,
    optimizer_state_bytes,
    strategy,
)


@dataclass(frozen=True)
class LayerPlan:
    """What the decoder layers run, for the run summary.

    Attributes:
        fp8: The float8 recipe, or None.
        fp8_layers: ``Float8Linear`` layers in the policy.
        checkpointing: The activation-checkpointing mode applied to the policy (``auto`` resolved).
        fit: The auto mode's measurement, when it ran.
        offload: Saved activations wait in host memory.
        tiled_mlp: The MLP's tiles (``"auto"`` or tokens per tile), None: untiled.
    """

    fp8: str | None = None
    fp8_layers: int = 0
    checkpointing: str = "off"
    fit: MemoryFit | None = None
    offload: bool = False
    tiled_mlp: int | str | None = None

    def describe(self) -> str:
        """`` | fp8 tensorwise (168 layers) | activation checkpointing layers:2`` (empty when nothing is set)."""
        parts = []
        if self.fp8 is not None:
            parts.append(f"fp8 {self.fp8} ({self.fp8_layers} Linear layers)")
        if self.fit is not None:
            parts.append(f"activation checkpointing {self.fit.describe()}")
        elif self.checkpointing != "off":
            parts.append(f"activation checkpointing {self.checkpointing}")
        if self.offload:
            parts.append("activations offloaded to host memory")
        if self.tiled_mlp is not None:
            size = "about hidden_size" if self.tiled_mlp == "auto" else str(self.tiled_mlp)
            parts.append(f"MLP in tiles of {size} tokens")
        return "".join(f" | {part}" for part in parts)


def prepare_layers(
    policy: torch.nn.Module,
    reference_model: torch.nn.Module | None,
    layers: LayerOptions,
    *,
    probe: Callable[[], None] | None,
    training: bool,
    fsdp: bool = False,
    budget: Budget | None = None,
) -> LayerPlan:
    """Converts, checkpoints, offloads and compiles as ``layers`` asks (each step idempotent).

    Args:
        policy: The policy, unwrapped (not yet DDP / FSDP wrapped).
        reference_model: The in-process reference model to convert and compile with it, or None.
        layers: The run's layer section (``fp8``, ``activation_checkpointing_mode``, ``activation_offload``,
            ``torch_compile*``).
        probe: One forward and backward of a ``max_tokens_per_microbatch`` row (the auto mode's measurement).
        training: False for an ``evaluate()`` before ``train()``: no checkpointing decision yet.
        fsdp: The policy will be sharded by FSDP2 (tensorwise float8 weights are then all-gathered in float8).
        budget: What the auto mode measures with (the token budget, the device, the ranks that agree).
    """
    if layers.fp8 is not None:
        convert_to_fp8(policy, layers.fp8, fsdp_float8_all_gather=fsdp and layers.fp8 == "tensorwise")
        if reference_model is not None:
            convert_to_fp8(reference_model, layers.fp8)
    auto = training and layers.activation_checkpointing_mode == "auto"
    fit = _measure(policy, probe, layers, budget, reference_model) if auto else None
    chosen = _chosen(layers, fit)
    if training:  # checkpointing, offload and tiles (the reference's tiles too)
        apply_strategy(policy, chosen, reference_model)
    else:  # an evaluate() before train(): no checkpointing decision yet, the tiles already
        for model in (policy, reference_model):
            if model is not None:
                apply_tiled_mlp(model, chosen.tiled_mlp)
    if layers.torch_compile:
        backend, compile_mode = layers.compile_backend, layers.torch_compile_mode
        if layers.fp8 is not None:  # the float8 casts round as in eager, in the policy's training graph and the
            torch._inductor.config.emulate_precision_casts = True  # reference's inference graph alike (ln 2 at step 0)
        compile_head_kernels(backend)  # the chunked head's element-wise work, fused
        compile_decoder_layers(policy, backend=backend, mode=compile_mode)
        if reference_model is not None:
            compile_decoder_layers(reference_model, backend=backend, mode=compile_mode)
        if fit is not None and fit.mode != CANDIDATES[0]:
            fit = _measure_compiled(policy, probe, layers, budget, fit, reference_model)
            chosen = _chosen(layers, fit)
    return LayerPlan(layers.fp8, count_fp8_layers(policy), chosen.mode, fit, chosen.offload, chosen.tiled_mlp)


def _kept(layers: LayerOptions) -> Strategy:
    """The config's own offload and tiles: on in every strategy (``auto``'s candidates too)."""
    return Strategy(layers.activation_checkpointing_mode, bool(layers.activation_offload), layers.tiled_mlp)


def _chosen(layers: LayerOptions, fit: MemoryFit | None) -> Strategy:
    """What the layers run: the auto mode's measured choice, else the config's settings."""
    kept = _kept(layers)
    return kept if fit is None else strategy(fit.mode, offload=kept.offload, tiled_mlp=kept.tiled_mlp)


@dataclass(frozen=True)
class ProbeInputs:
    """What the auto mode's probe row runs through besides the policy.

    Attributes:
        reference_logps: The reference's per-sequence log-probs of a batch (the reference is built on first use).
        collator: The run's packing collator (its layout and pad rule).
        autocast: The mixed-precision context of the prepared policy's forward (the Accelerator's ``autocast``).
    """

    reference_logps: Callable[[PackedPairBatch], torch.Tensor]
    collator: PackedPairCollator
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def prepare_run_layers(
    policy: torch.nn.Module,
    reference_model: torch.nn.Module | None,
    layers: LayerOptions,
    limits: BatchLimits,
    *,
    training: bool,
    probe_inputs: ProbeInputs,
    fsdp: bool,
    budget: Budget,
) -> LayerPlan:
    """:func:`prepare_layers` for a run, with the probe row of the token budget built when the auto checkpointing
    mode measures (``training`` and ``activation_checkpointing_mode='auto'``)."""
    probe = None
    if training and layers.activation_checkpointing_mode == "auto":
        vocab = int(unwrap_model(policy).get_input_embeddings().weight.shape[0])
        probe = budget_probe(
            policy,
            probe_inputs.reference_logps,
            probe_inputs.collator,
            limits,
            vocab_size=vocab,
            device=budget.device,
            chunk_size=layers.logps_chunk_size,
            autocast=probe_inputs.autocast,
        )
    return prepare_layers(policy, reference_model, layers, probe=probe, training=training, fsdp=fsdp, budget=budget)


COMPILED_TRIES = 3
"""At most this many modes cheaper than the eager choice are measured again through the compiled layers: each one
is a compiled graph of the layer, and Dynamo keeps eight per function (the reference's and evaluation's graphs and
the chosen mode's must still fit)."""


@dataclass(frozen=True)
class Budget:
    """What the auto checkpointing mode measures with.

    Attributes:
        tokens: ``max_tokens_per_microbatch`` (None: no budget, which ``run_problems`` refuses with ``auto``).
        device: This rank's device (its peak memory is measured).
        world_size: The ranks that agree on the mode.
    """

    tokens: int | None
    device: torch.device | str
    world_size: int = 1


def _measure(
    policy: torch.nn.Module,
    probe: Callable[[], None] | None,
    layers: LayerOptions,
    budget: Budget | None,
    reference: torch.nn.Module | None,
    candidates: Sequence[str] = CANDIDATES,
) -> MemoryFit:
    """The first of ``candidates`` that fits on every rank (the most recompute any rank needs)."""
    assert probe is not None and budget is not None and budget.tokens is not None  # run_problems refuses otherwise
    fit = choose_checkpointing(
        policy,
        probe,
        CudaPeakMeter(torch.device(budget.device)),
        pending_bytes=optimizer_state_bytes(policy),
        tokens=budget.tokens,
        candidates=candidates,
        kept=_kept(layers),
        reference=reference,
    )
    return _agreed(policy, fit, layers, budget, reference)


def _measure_compiled(
    policy: torch.nn.Module,
    probe: Callable[[], None] | None,
    layers: LayerOptions,
    budget: Budget | None,
    eager: MemoryFit,
    reference: torch.nn.Module | None,
) -> MemoryFit:
    """The eager probe's choice ``eager``, or a cheaper mode that fits once the layers are compiled.

    A compiled layer keeps less for backward than the same layer run eagerly (inductor's partitioner recomputes
    cheap element-wise results instead of saving them), so a mode the eager probe rejected may fit. The cheaper
    modes (up to :data:`COMPILED_TRIES`) run the probe again through the compiled layers; each rank falls back to
    ``eager`` when none fits, and the ranks agree as before.
    """
    cheaper = CANDIDATES[: CANDIDATES.index(eager.mode)][:COMPILED_TRIES]
    compiled = _measure(policy, probe, layers, budget, reference, cheaper)
    chosen = replace(compiled, compiled=True) if compiled.fits else eager
    chosen = _agreed(policy, chosen, layers, budget, reference)
    apply_strategy(policy, _chosen(layers, chosen), reference)  # the probe left the last candidate it tried marked
    return chosen


def _agreed(
    policy: torch.nn.Module,
    fit: MemoryFit,
    layers: LayerOptions,
    budget: Budget | None,
    reference: torch.nn.Module | None,
) -> MemoryFit:
    """``fit`` with the candidate of the rank that needs the most (ranks must checkpoint the same layers)."""
    world_size = budget.world_size if budget is not None else 1
    agreed = most_conservative(all_gather_cpu(fit.mode)) if world_size > 1 else fit.mode
    if agreed != fit.mode:  # another rank needs more: every rank runs the same strategy
        fit = replace(fit, mode=agreed)
        apply_strategy(policy, _chosen(layers, fit), reference)
    return fit


def auto_checkpointing_problems(mode: str, *, device: torch.device, sharded: bool) -> list[Problem]:
    """``activation_checkpointing_mode='auto'`` measures GPU memory on one unsharded model: CUDA, not ZeRO-3 / FSDP2."""
    if mode != "auto":
        return []
    problems: list[Problem] = []
    if device.type != "cuda":
        problems.append(
            (
                "unsupported_combination",
                "activation_checkpointing_mode='auto' measures the peak GPU memory of the token budget, but this run "
                "has no CUDA device: name a mode ('off', 'full', 'selective', 'layers:K').",
            )
        )
    if sharded:
        problems.append(
            (
                "unsupported_combination",
                "activation_checkpointing_mode='auto' measures one unsharded model, not a DeepSpeed ZeRO-3 or FSDP2 "
                "shard: name a mode ('off', 'full', 'selective', 'layers:K').",
            )
        )
    return problems


def budget_probe(
    policy: torch.nn.Module,
    reference_logps: Callable[[PackedPairBatch], torch.Tensor],
    collator: PackedPairCollator,
    limits: BatchLimits,
    *,
    vocab_size: int,
    device: torch.device | str,
    chunk_size: int,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> Callable[[], None]:
    """One forward and backward of a synthetic packed row of exactly ``max_tokens_per_microbatch`` tokens (pairs of
    256-token prompts and completions within the length limits), through the policy's log-prob head and the
    reference, as a training micro-batch runs them.

    Args:
        limits: The run's batch limits (the budget and the length limits the synthetic pairs keep within).
        device: This rank's device.
        chunk_size: The log-prob head's chunk (``logps_chunk_size``).
        autocast: The mixed-precision context the prepared policy's ``forward`` will run in (the Accelerator's
            ``autocast``): the probe runs the policy's forward inside it, so the layers compiled for the probe are
            the graphs training runs (Dynamo compiles a layer again when the autocast state differs) and the peak
            measured is theirs.
    """
    budget = int(limits.max_tokens_per_microbatch or 0)
    prompt = min(256, int(limits.max_prompt_length or 1), max(1, budget // 4))
    completion = max(1, min(256, limits.max_length - prompt))
    per_pair = (1 if collator.share_prompt else 2) * prompt + 2 * completion  # the collator's layout
    features = [
        {
            "prompt_input_ids": [3 + i % (vocab_size - 3)] * prompt,
            "chosen_input_ids": [4 + i % (vocab_size - 4)] * completion,
            "rejected_input_ids": [5 + i % (vocab_size - 5)] * completion,
        }
        for i in range(max(1, budget // per_pair))
    ]
    batch = collator(features).to(torch.device(device))

    def probe() -> None:
        policy.train()
        with _forward_under(policy, autocast):
            logps = packed_policy_logps(policy, batch, chunk_size=chunk_size).logps
        with torch.no_grad():
            ref = reference_logps(batch)
        (logps - ref).sum().backward()

    return probe


@contextlib.contextmanager
def _forward_under(model: torch.nn.Module, context: Callable[[], contextlib.AbstractContextManager]) -> Iterator[None]:
    """``model.forward`` runs inside ``context()`` for the block, as accelerate's mixed precision runs a prepared
    model's forward (the log-prob head outside it, as in training)."""
    forward = model.forward

    def wrapped(*args, **kwargs):
        with context():
            return forward(*args, **kwargs)

    with forward_replaced(model, wrapped):
        yield


class Fp8ScaleCallback(TrainerCallback):
    """FSDP2 with float8 all-gather: after every optimizer step, all converted weights' scales in one all-reduce."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def on_optimizer_step(self, args, state, control, **kwargs):
        precompute_fp8_scales(self.model)
