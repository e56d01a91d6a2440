"""Pieces of ``dpo.py`` that its ceiling loops (``ceiling.py``) share: the workload's vocabulary, the
step-timing probe and the fields of the JSON rows. Modules of the ``benchmarks`` package."""

from __future__ import annotations

import statistics
from typing import Any

import torch

VOCAB = 32000
"""Token ids of the workload are drawn from [3, VOCAB) for every model size (the TRL script's vocabulary)."""


def tf32_matmul() -> bool:
    """Whether fp32 matmuls may use TF32. Reads torch's new ``fp32_precision`` API when it exists: once anything
    (transformers' ``enable_tf32`` with ``torch_compile=True``) used it, reading the legacy ``allow_tf32`` raises."""
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if precision is not None:
        return precision == "tf32"
    return bool(torch.backends.cuda.matmul.allow_tf32)


# --------------------------------------------------------------------------------------------------- timing
def dynamo_graphs() -> int:
    """Graphs ``torch.compile`` has produced in this process so far (recompiles included)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class Probe:
    """State shared by the step callback and the trainer: step times, tokens per micro-batch, the profiler, and
    (with ``count_graphs``) the ``torch.compile`` graph count at every step end."""

    def __init__(self, cuda: bool, profile_step: int | None, count_graphs: bool = False) -> None:
        self.cuda = cuda
        self.count_graphs = count_graphs
        self.progress = False
        self.graphs0 = dynamo_graphs() if count_graphs else 0
        self.graphs: list[int] = []  # graph count at each on_step_end
        self.begins: list[float] = []
        self.ends: list[float] = []
        self.tokens: list[tuple[int, int, int]] = []  # (step, real tokens, row length T) per micro-batch
        self.trl_tokens: list[tuple[int, int]] = []  # (step, tokens with each prompt twice) per micro-batch
        self.profile_step = profile_step
        self.profiler: Any = None
        self.events: Any = None
        self._regions: list[Any] = []

    @property
    def profiling(self) -> bool:
        return self.profiler is not None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def open_region(self, name: str) -> None:
        if self.profiling:
            region = torch.profiler.record_function(name)
            region.__enter__()
            self._regions.append(region)

    def close_region(self) -> None:
        if self.profiling and self._regions:
            self._regions.pop().__exit__(None, None, None)

    def start_profiler(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.profiler = profile(activities=activities, with_stack=True)
        self.profiler.start()

    def stop_profiler(self) -> None:
        while self._regions:
            self.close_region()
        self.profiler.stop()
        self.events = self.profiler.events()
        self.profiler = None


# --------------------------------------------------------------------------------------------------- results
def param_counts(model: torch.nn.Module) -> tuple[int, int]:
    """``(all parameters, parameters whose matmul runs per token)``; ZeRO-3 partitioned tensors count in full.

    The second is all parameters minus the input embedding (a lookup, no FLOPs), except for a TIED head: the embedding
    matrix is then also the LM head, whose matmul runs per token, so it stays in (counted once, as ``parameters()``
    yields a shared tensor once). A PEFT model counts its base weights and adapters.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> dims = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, vocab_size=10)
        >>> untied, tied = (LlamaForCausalLM(LlamaConfig(**dims, tie_word_embeddings=t)) for t in (False, True))
        >>> param_counts(untied)[0] - param_counts(untied)[1], param_counts(tied)[0] - param_counts(tied)[1]
        (80, 0)
    """
    total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is embed:
        return total, total
    return total, total - getattr(embed, "ds_numel", embed.numel())


def mfu_fields(tok_s: float, n_all: int, n_noembed: int, factor: int) -> dict[str, float]:
    """MFU columns: TRL's exact ``8 x all params`` and ours (``factor x`` non-embedding / all params)."""
    return {
        "mfu8N_989": round(8 * n_all * tok_s / 989e12, 4),
        "mfu8N_790": round(8 * n_all * tok_s / 790e12, 4),
        "mfu_noembed_989": round(factor * n_noembed * tok_s / 989e12, 4),
        "mfu_noembed_790": round(factor * n_noembed * tok_s / 790e12, 4),
        "mfu_allparams_989": round(factor * n_all * tok_s / 989e12, 4),
        "flops_per_token_factor": factor,
    }


def step_stats(dts: list[float]) -> dict[str, Any]:
    """Median / mean / min / max of the timed step times."""
    return {
        "steps_timed": len(dts),
        "step_median_s": round(statistics.median(dts), 4),
        "step_mean_s": round(sum(dts) / len(dts), 4),
        "step_min_s": round(min(dts), 4),
        "step_max_s": round(max(dts), 4),
    }


def memory_fields(cuda: bool) -> dict[str, Any]:
    """Peak allocated / reserved GiB since the last reset (None on CPU)."""
    return {
        "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda else None,
    }


def timed_tokens(probe: Probe, warmup: int) -> tuple[list[float], list[tuple[int, int, int]]]:
    """Step times of the steps after ``warmup`` (TRL's ``ends`` differences) and their micro-batch token records."""
    ends = probe.ends
    dts = [ends[i] - ends[i - 1] for i in range(max(warmup, 1), len(ends))]
    first = len(ends) - len(dts)
    log = [t for t in probe.tokens if first <= t[0] < len(ends)]
    return dts, log


def option_fields(args: Any) -> dict[str, Any]:
    """The memory / precision options a ``benchmarks.dpo`` row ran with (None: the flag was not given, the trainer's
    default ran): LoRA rank, HF gradient checkpointing, the trainer's activation checkpointing / offload and fp8."""
    return {
        "lora_r": getattr(args, "lora", None),
        "gradient_checkpointing": bool(getattr(args, "gradient_checkpointing", False)),
        "activation_checkpointing": getattr(args, "activation_checkpointing", None),
        "activation_offload": bool(getattr(args, "activation_offload", False)),
        "tiled_mlp": getattr(args, "tiled_mlp", None),
        "fp8": getattr(args, "fp8", None),
    }


def hf_checkpointing_on(model: torch.nn.Module) -> bool:
    """Whether HF's own per-layer checkpointing is on ``model`` (``is_activation_checkpointing`` in transformers 5.24,
    ``is_gradient_checkpointing`` in 5.17; a PEFT model answers for its base model)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(base), name):
            return bool(getattr(base, name))
    return False


def row_head(ctx: dict[str, Any], trainer: Any, impl: str, tok_s: float, tag: str | None = None) -> dict[str, Any]:
    """Fields every row shares: what ran (tag, impl, rank, model, reference, attention, compile, memory / precision
    options), tok/s and MFU."""
    args = ctx["args"]
    n_all, n_noembed = ctx["params"]
    factor = 8 if args.reference == "online" else 6  # 6N policy fwd+bwd, plus 2N for an online reference forward
    return {
        "tag": tag or args.tag,
        "impl": impl,
        "rank": ctx["rank"],
        "world": ctx["world"],
        "model_size": args.model_size,
        "reference": args.reference,
        "attn": f"pair_varlen:{trainer.attn_backend}",
        "compile": bool(args.compile),
        "compile_backend": args.compile_backend if args.compile else None,
        "compile_mode": args.compile_mode,
        **option_fields(args),
        "real_tok_s_gpu": round(tok_s, 1),
        **mfu_fields(tok_s, n_all, n_noembed, factor),
    }


def graph_fields(graphs0: int, graphs: list[int], untimed: int) -> dict[str, int]:
    """``torch.compile`` graphs made during the untimed first steps and during the timed steps (0 expected: a
    compile inside a timed step would be counted in its step time). ``graphs[i]`` is the count after step ``i``."""
    before = graphs[untimed - 1] if untimed > 0 else graphs0
    return {"dynamo_graphs_warmup": before - graphs0, "dynamo_graphs_timed": graphs[-1] - before}


def fsdp_fields(trainer: Any) -> dict[str, Any]:
    """``fsdp2``: whether the policy ran under FSDP2; ``reference_fsdp``: ``sharded`` / ``replicated`` (None when
    there is no FSDP2 or no reference model); ``fsdp_param_dtype``: the dtype FSDP2 gathered parameters in."""
    plugin = getattr(trainer, "fsdp_plugin", None)
    if plugin is None:
        return {"fsdp2": False, "reference_fsdp": None, "fsdp_param_dtype": None}
    from torch.distributed.tensor import DTensor

    built = trainer.reference_manager.reference_if_built
    reference = built.model if built is not None else None
    layout = None
    if reference is not None:
        layout = "sharded" if any(isinstance(p, DTensor) for p in reference.parameters()) else "replicated"
    dtype = getattr(plugin.mixed_precision_policy, "param_dtype", None)
    return {"fsdp2": True, "reference_fsdp": layout, "fsdp_param_dtype": str(dtype) if dtype else None}
