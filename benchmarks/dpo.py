"""Throughput benchmark of ``PairDPOTrainer`` on the fixed comparison workload (side by side with TRL's DPOTrainer).

The workload, the timing and the ``RESULT`` fields mirror ``trl_dpo.py`` (TRL's DPOTrainer, same package) so the rows
of the two sides are directly comparable (``python -m benchmarks.run`` runs both; see ``docs/benchmarks_howto.md``):

* random-init Llama (``--model-size 254m``: hidden 1024, 16 layers, 16/8 heads, vocab 32000), bf16 weights and
  ``bf16=True``, no gradient checkpointing, 8 pairs per GPU per optimizer step, ``max_length`` 2048, seed 0;
* pairs of token ids drawn with ``numpy.random.default_rng(seed)`` by ``workload.make_pairs`` (the TRL side's too):
  prompt U[32, 512]; chosen / rejected ``clip(round(lognormal(log 200, 0.9)), 16, 1024)`` each ending with EOS (id 1);
  the same ``(warmup + steps + 2) * pairs_per_step * world`` pairs, so both sides see the same pair pool;
* a ``TrainerCallback`` synchronises CUDA at ``on_step_begin`` / ``on_step_end`` only; step times are differences of
  consecutive ``on_step_end`` times (TRL's method: data loading, all micro-batches, clipping and the optimizer step);
  the first ``--warmup`` steps are excluded; tokens/s (``real_tok_s_gpu``) = the tokens packed and computed in the
  timed steps (prompt + chosen + rejected per pair with ``share_prompt``, else prompt + chosen and prompt + rejected)
  / the sum of their step times, per GPU; ``trl_tok_s_gpu`` counts the same steps' tokens as TRL computes them (each
  prompt twice), the like-for-like figure against a TRL row; rows carry ``share_prompt`` (the layout that ran),
  ``trl_tokens_per_step`` and ``prompt_tokens_saved_frac`` (``--share-prompt`` / ``--no-share-prompt`` set
  ``PairDPOConfig.share_prompt``; neither: the config's default, on where the model supports it);
* MFU: ``mfu8N_989`` / ``mfu8N_790`` are TRL's formula exactly (8 x ALL parameters per token, embeddings included,
  against 989 / 790 TFLOP/s); ``mfu_noembed_989`` uses ``k x`` the non-embedding parameters (``k`` = 8 with a
  reference: 6 for the policy's forward and backward + 2 for the reference forward; 6 with ``--reference free``;
  non-embedding = all parameters minus the input embedding, the LM head counted), ``mfu_allparams_989`` the same
  ``k`` with all parameters. Attention FLOPs are excluded everywhere. Every MFU counts the tokens packed (the FLOPs
  done: a shared prompt once).

Ceilings (raw loops after training, same process, same model and reference, optimizer state dropped; policy
``packed_sequence_logps`` forward + backward plus the reference's no-grad forward under bf16 autocast, CUDA sync
around each step, the first ``--warmup`` steps untimed; NO optimizer step, no Trainer, no data loading):

* ``--ceiling``: each step's pairs (this rank's schedule) as ONE packed row (``impl`` ``pair_dpo_ceiling``);
* ``--ceiling-shape DOCSxLEN``: the issue's packed ceiling, DOCS random documents of exactly LEN tokens in one row
  (``cu_seqlens`` every LEN tokens, every non-first token scored), DOCS x LEN real tokens per step (``impl``
  ``pair_dpo_ceiling_shape``, tag ``<tag>_ceilingDOCSxLEN``).

Token budget: ``--max-tokens-per-microbatch B`` sets ``PairDPOConfig.max_tokens_per_microbatch=B`` (``--bs`` is then
the pairs per GPU per optimizer step, ``--ga`` must stay 1; ``--pad-to-budget`` pads every row to ``B``); ``--mix
heavy`` draws the lengths of ``sampler.py``'s heavy-tailed mix instead of TRL's workload. In budget runs
``--ceiling`` times each step's micro-batch rows as the trainer ran them (rows of ``<= B`` tokens), not one row.
Rows carry ``mix``, ``max_tokens_per_microbatch``, ``pad_to_budget``, ``microbatches_per_step_mean`` / ``_max`` and
``alloc_conf`` (``PYTORCH_CUDA_ALLOC_CONF`` as the process saw it).

Memory and precision options (each recorded in every row; the trainer's options are passed only when this version of
``PairDPOConfig`` has the field, else the flag is refused with a message): ``--lora R`` wraps the policy with peft LoRA
(rank R on q, k, v, o, gate, up, down; alpha 2R; dropout 0; the reference is then the adapter-disabled policy, no
copy); ``--gradient-checkpointing`` is HF's ``TrainingArguments.gradient_checkpointing`` (non-reentrant);
``--activation-checkpointing MODE`` (``off``, ``full``, ``selective``, ``layers:K``, ``auto``), ``--activation-offload``
and ``--fp8 RECIPE`` (``tensorwise``, ``rowwise``; needs torchao) are the trainer's ``activation_checkpointing_mode``,
``activation_offload`` and ``fp8``.

``--compile`` sets ``torch_compile=True`` (the trainer compiles the policy's and the reference's decoder layers in
``train()``; the graphs are built in the first, untimed, step) and the ceiling loops compile the same layers with
``compile_decoder_layers`` before their warmup steps (a no-op when the trainer already did). Every row carries
``compile`` / ``compile_backend`` / ``compile_mode``, and with ``--compile`` ``dynamo_graphs_warmup`` /
``dynamo_graphs_timed`` (graphs built during the untimed / timed steps: 0 timed expected, else a WARNING).

Each rank prints ``RESULT {json}`` (and ``CEILING {json}`` per ceiling) and appends it to
``$OUT/results.jsonl`` when ``OUT`` is set (or to ``--results``).

Examples:
    python -m benchmarks.dpo --tag ours --ceiling --ceiling-shape 16x1024
    python -m benchmarks.dpo --tag ours_compile --compile --ceiling --ceiling-shape 16x1024
    python -m benchmarks.dpo --tag ours_prof --profile          # writes $OUT/profile_summary.txt
    python -m benchmarks.dpo --tag ours_1p5b --model-size 1.5b --bs-for-tokens 16384
    python -m benchmarks.dpo --tag heavy_b16k --model-size 1.5b --mix heavy --bs 32 --max-tokens-per-microbatch 16384
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 -m benchmarks.dpo --tag z3
    accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 1 -m benchmarks.dpo --tag fsdp2
    python -m benchmarks.dpo --tiny --ceiling --profile          # CPU smoke test (tiny model, fp32, 3 steps)
    python -m benchmarks.dpo --tiny --compile --compile-backend aot_eager --ceiling --ceiling-shape 2x16 --profile
    python -m benchmarks.dpo --tiny --model-size tiny-qwen --lora 4 --gradient-checkpointing --ceiling
    python -m benchmarks.dpo --tag ac_l2 --model-size 8b --compile --activation-checkpointing layers:2
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import os
import re
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback, TrainingArguments

from benchmarks import profile_summary
from benchmarks.ceiling import run_ceiling, run_shape_ceiling, shape_batches  # noqa: F401  (shape_batches: tests)
from benchmarks.clocks import clock_fields, sampled
from benchmarks.report import emit, summary_table
from benchmarks.rows import (
    Probe,
    dynamo_graphs,
    fsdp_fields,
    graph_fields,
    hf_checkpointing_on,
    memory_fields,
    option_fields,
    param_counts,
    row_head,
    step_stats,
    tf32_matmul,
    timed_tokens,
)
from benchmarks.workload import MODEL_SIZES, lora_config, make_pairs, make_tokenizer, token_vocab
from benchmarks.workload import build_model as build_workload_model
from pair_dpo_trainer.collators.step import StepBatch
from pair_dpo_trainer.config import PairDPOConfig
from pair_dpo_trainer.data.costs import pair_costs
from pair_dpo_trainer.trainer import PairDPOTrainer

PROCESS_START = time.perf_counter()
PEAK_TFLOPS = (989, 790)
FP8_RECIPES = ("tensorwise", "rowwise")
TINY_SIZES = ("tiny", "tiny-qwen")
MIX_LIMITS = {"trl": (None, 512), "heavy": (8192, 4096), "long": (20480, 16384)}
"""Per ``--mix``: (``max_length``, None: ``--max-length``; ``max_prompt_length``), so no pair of the mix is cut."""
NEW_FIELDS = {  # PairDPOConfig field -> the flag that sets it (passed only when the field exists)
    "activation_checkpointing_mode": "--activation-checkpointing",
    "activation_offload": "--activation-offload",
    "tiled_mlp": "--tiled-mlp",
    "fp8": "--fp8",
    "share_prompt": "--share-prompt / --no-share-prompt",
}


# --------------------------------------------------------------------------------------------------- arguments
def parse_shape(text: str) -> tuple[int, int]:
    """``"16x1024"`` -> ``(16, 1024)``: an even number of documents (they are packed as pairs) of >= 2 tokens.

    Example:
        >>> parse_shape("16x1024")
        (16, 1024)
    """
    match = re.fullmatch(r"(\d+)[xX](\d+)", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r}: expected DOCSxLEN, e.g. 16x1024")
    docs, length = int(match.group(1)), int(match.group(2))
    if docs < 2 or docs % 2 or length < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: DOCS must be even and >= 2, LEN >= 2")
    return docs, length


def parse_ac(text: str) -> str:
    """An ``--activation-checkpointing`` mode: ``off``, ``full``, ``selective``, ``auto`` or ``layers:K`` (K >= 1).

    Example:
        >>> parse_ac("layers:2"), parse_ac("auto")
        ('layers:2', 'auto')
    """
    value = text.strip()
    if value in ("off", "full", "selective", "auto") or re.fullmatch(r"layers:[1-9]\d*", value):
        return value
    raise argparse.ArgumentTypeError(f"{text!r}: expected off, full, selective, auto or layers:K (K >= 1)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (``--tiny`` changes the defaults left unset to a CPU smoke test)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tag", default="pair_dpo")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="254m")
    p.add_argument(
        "--tiny",
        action="store_true",
        help="tiny model (tiny, or tiny-qwen when given as --model-size), fp32, CPU allowed, 2 pairs x (2 + 3) steps",
    )
    p.add_argument("--bs", "--per-device-train-batch-size", dest="bs", type=int, help="pairs per micro-batch (8)")
    p.add_argument("--ga", "--gradient-accumulation-steps", dest="ga", type=int, default=1)
    p.add_argument("--bs-for-tokens", type=int, help="fixed split: choose --bs so a micro-batch holds ~N real tokens")
    p.add_argument(
        "--max-tokens-per-microbatch",
        type=int,
        help="PairDPOConfig.max_tokens_per_microbatch (token budget): --bs is then pairs per GPU per step, --ga 1",
    )
    p.add_argument("--pad-to-budget", action="store_true", help="PairDPOConfig.pad_to_budget (needs the budget)")
    p.add_argument(
        "--share-prompt",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="PairDPOConfig.share_prompt: --share-prompt requires the prompt packed once, --no-share-prompt packs it "
        "twice (TRL's layout); neither: the config's default (on where the model supports it)",
    )
    p.add_argument(
        "--mix",
        choices=("trl", "heavy", "long"),
        default="trl",
        help="trl: TRL's workload; heavy: heavy tail; long: prompts of 8-16k tokens, completions ~1k",
    )
    p.add_argument("--steps", type=int, help="timed optimizer steps (30)")
    p.add_argument("--warmup", type=int, help="untimed first steps (5)")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--workers", "--dataloader-num-workers", dest="workers", type=int, help="DataLoader workers (2)")
    p.add_argument("--attn-backend", default="auto", help="PairDPOConfig.attn_backend")
    p.add_argument(
        "--reference",
        choices=("online", "free", "precomputed"),
        default="online",
        help="online: frozen reference forward per micro-batch; free: reference_free=True; precomputed: "
        "precompute_ref_log_probs=True (reference pass before the first step, not timed)",
    )
    p.add_argument(
        "--ref-source",
        choices=("explicit", "trainer"),
        default="explicit",
        help="explicit: pass ref_model=<in-memory copy>; trainer: let PairDPOTrainer build the reference itself",
    )
    p.add_argument(
        "--ref-zero-stage",
        type=int,
        choices=(0, 3),
        help="PairDPOConfig.ref_zero_stage under DeepSpeed (0: replicated reference engine, 3: sharded; default: "
        "follow the policy), when this version of the package has the field",
    )
    p.add_argument(
        "--ref-fsdp-shard",
        choices=("true", "false"),
        help="PairDPOConfig.ref_fsdp_shard under FSDP2 (true: reference sharded per decoder layer, false: replicated; "
        "default: follow the policy, i.e. sharded)",
    )
    p.add_argument(
        "--zero3-leaf-modules",
        help="PairDPOConfig.zero3_leaf_modules under ZeRO-3 ('auto': decoder layers, 'none', or class names)",
    )
    p.add_argument("--logps-chunk-size", type=int, default=4096)
    p.add_argument("--ceiling", action="store_true", help="also time the raw packed fwd+bwd (+ref fwd) loop")
    p.add_argument(
        "--ceiling-shape",
        metavar="DOCSxLEN",
        type=parse_shape,
        help="also time the raw loop on DOCS random documents of exactly LEN tokens in one packed row (16x1024)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch_compile=True: regional torch.compile of the policy's and reference's decoder layers (the "
        "ceiling loops compile them too); the compile happens in the untimed warmup steps",
    )
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend with --compile (inductor)")
    p.add_argument("--compile-mode", help="torch.compile mode with --compile (default; max-autotune-no-cudagraphs)")
    p.add_argument("--profile", action="store_true", help="torch.profiler over the last warmup step")
    p.add_argument(
        "--lora",
        type=int,
        metavar="R",
        help="peft LoRA of rank R on q,k,v,o,gate,up,down (alpha 2R, dropout 0); reference = adapter-disabled policy",
    )
    p.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="TrainingArguments.gradient_checkpointing=True (HF's per-layer checkpointing, use_reentrant=False)",
    )
    p.add_argument(
        "--activation-checkpointing",
        type=parse_ac,
        metavar="MODE",
        help="PairDPOConfig.activation_checkpointing_mode: off, full, selective, layers:K (every K-th decoder layer) "
        "or "
        "auto (the cheapest setting that fits the token budget, measured at start)",
    )
    p.add_argument("--activation-offload", action="store_true", help="PairDPOConfig.activation_offload=True")
    p.add_argument("--tiled-mlp", metavar="N|auto", help="PairDPOConfig.tiled_mlp: the MLP in tiles of N tokens")
    p.add_argument("--fp8", choices=FP8_RECIPES, metavar="RECIPE", help="PairDPOConfig.fp8: tensorwise or rowwise")
    p.add_argument("--progress", action="store_true", help="rank 0 prints each step's time and the setup phases")
    p.add_argument("--no-cudnn-sdp", "--no_cudnn_sdp", dest="no_cudnn_sdp", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--summarize", metavar="JSONL", help="only print a markdown table of the rows of this file")
    p.add_argument("--results", help="JSONL file to append to (default: $OUT/results.jsonl when OUT is set)")
    args = p.parse_args(argv)
    tiny = {"bs": 2, "steps": 3, "warmup": 2, "workers": 0}
    full = {"bs": 8, "steps": 30, "warmup": 5, "workers": 2}
    for key, value in (tiny if args.tiny else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.tiny and args.model_size not in TINY_SIZES:
        args.model_size = "tiny"
    if args.lora is not None and args.lora < 1:
        p.error("--lora R needs a rank R >= 1")
    if args.gradient_checkpointing and args.activation_checkpointing not in (None, "off"):
        p.error("--gradient-checkpointing and --activation-checkpointing would both recompute layers: keep one")
    if args.compile_mode is not None and not args.compile:
        p.error("--compile-mode needs --compile")
    if args.max_tokens_per_microbatch and (args.ga != 1 or args.bs_for_tokens):
        p.error("--max-tokens-per-microbatch packs the step by tokens: keep --ga 1 and drop --bs-for-tokens")
    if args.pad_to_budget and not args.max_tokens_per_microbatch:
        p.error("--pad-to-budget needs --max-tokens-per-microbatch")
    if args.results is None and os.environ.get("OUT"):
        args.results = os.path.join(os.environ["OUT"], "results.jsonl")
    return args


def _progress(args: argparse.Namespace, what: str) -> None:
    if args.progress and int(os.environ.get("RANK", "0")) == 0:
        print(f"progress: {what}, {time.perf_counter() - PROCESS_START:.1f} s since start", flush=True)


# --------------------------------------------------------------------------------------------------- workload
def pairs_per_microbatch(args: argparse.Namespace) -> int:
    """``--bs``, or with ``--bs-for-tokens N`` the pair count whose mean packed row is ~N tokens."""
    if not args.bs_for_tokens:
        return args.bs
    mean_cost = float(np.mean(pair_costs(make_pairs(2048, args.seed, args.mix))))
    return max(1, round(args.bs_for_tokens / mean_cost))


def build_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """The random-init model of ``--model-size`` (``workload.build_model``, the TRL side's builder too), bf16 on CUDA
    unless ``--tiny``, on ``device`` (the 1.5B and 8B sizes are initialised on the GPU)."""
    dtype = torch.bfloat16 if device.type == "cuda" and not args.tiny else None
    return build_workload_model(args.model_size, seed=args.seed, device=device, dtype=dtype)


def apply_lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """``peft.get_peft_model`` with ``workload.lora_config(rank)`` (the TRL side passes the same config)."""
    from peft import get_peft_model

    return get_peft_model(model, lora_config(rank))


def build_config(args: argparse.Namespace, bs: int, total_steps: int, bf16: bool) -> PairDPOConfig:
    """``PairDPOConfig`` with the TRL script's Trainer settings (lr 1e-6, no logging or saving in the run)."""
    kwargs: dict[str, Any] = dict(
        output_dir=os.path.join(tempfile.gettempdir(), f"pair_dpo_bench_{args.tag}"),
        per_device_train_batch_size=bs,
        gradient_accumulation_steps=args.ga,
        max_steps=total_steps,
        learning_rate=1e-6,
        bf16=bf16,
        logging_steps=10_000,
        save_strategy="no",
        report_to="none",
        max_length=MIX_LIMITS[args.mix][0] or args.max_length,
        max_prompt_length=MIX_LIMITS[args.mix][1],
        dataloader_num_workers=args.workers,
        seed=args.seed,
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
        attn_backend=args.attn_backend,
        reference_free=args.reference == "free",
        logps_chunk_size=args.logps_chunk_size,
        max_tokens_per_microbatch=args.max_tokens_per_microbatch,
        pad_to_budget=args.pad_to_budget,
    )
    if args.gradient_checkpointing:  # HF's: the Trainer enables it on the model in train()
        kwargs.update(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.compile:  # the trainer compiles the decoder layers at the start of train() (modeling/compile.py)
        kwargs.update(torch_compile=True, torch_compile_backend=args.compile_backend)
        if args.compile_mode is not None:
            kwargs["torch_compile_mode"] = args.compile_mode
    fields = trainer_fields()
    if "allow_unpinned_reference" in fields and args.reference != "free":
        kwargs["allow_unpinned_reference"] = True  # an in-memory random-init reference has no pinned snapshot
    if args.ref_zero_stage is not None:
        if "ref_zero_stage" not in fields:
            raise SystemExit("--ref-zero-stage needs PairDPOConfig.ref_zero_stage (not in this version)")
        kwargs["ref_zero_stage"] = args.ref_zero_stage
    if args.zero3_leaf_modules is not None:
        kwargs["zero3_leaf_modules"] = args.zero3_leaf_modules
    if args.ref_fsdp_shard is not None:
        if "ref_fsdp_shard" not in fields:
            raise SystemExit("--ref-fsdp-shard needs PairDPOConfig.ref_fsdp_shard (not in this version)")
        kwargs["ref_fsdp_shard"] = args.ref_fsdp_shard == "true"
    if args.reference == "precomputed":
        if "precompute_ref_log_probs" not in fields:
            raise SystemExit(
                "--reference precomputed needs PairDPOConfig.precompute_ref_log_probs (not in this version)"
            )
        kwargs["precompute_ref_log_probs"] = True
    kwargs.update(new_option_kwargs(args, fields))
    return PairDPOConfig(**kwargs)


def trainer_fields(config_class: type = PairDPOConfig) -> set[str]:
    """The field names of ``config_class`` (``PairDPOConfig``) minus transformers' own fields of the same name and
    declaration: transformers 5.24's ``TrainingArguments`` has ``activation_checkpointing: bool | None`` (the new name
    of ``gradient_checkpointing``; 5.17 has none), which is not the trainer's ``activation_checkpointing`` mode. A field
    the trainer redeclares (another type or default) counts as the trainer's.

    Example:
        >>> "activation_checkpointing" in trainer_fields(TrainingArguments), "max_length" in trainer_fields()
        (False, True)
    """
    hf = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    return {
        f.name
        for f in dataclasses.fields(config_class)
        if f.name not in hf or (f.type, f.default) != (hf[f.name].type, hf[f.name].default)
    }


def new_option_kwargs(args: argparse.Namespace, fields: set[str]) -> dict[str, Any]:
    """``activation_checkpointing`` / ``activation_offload`` / ``tiled_mlp`` / ``fp8`` / ``share_prompt`` for the flags
    given (nothing
    for the flags left out, so the config's defaults run); SystemExit when a flag is given and ``PairDPOConfig`` lacks
    its field, or ``--fp8`` without torchao."""
    given = {
        "activation_checkpointing_mode": args.activation_checkpointing,
        "activation_offload": True if args.activation_offload else None,
        "tiled_mlp": getattr(args, "tiled_mlp", None),
        "fp8": args.fp8,
        "share_prompt": getattr(args, "share_prompt", None),
    }
    kwargs = {name: value for name, value in given.items() if value is not None}
    for name in kwargs:
        if name not in fields:
            raise SystemExit(f"{NEW_FIELDS[name]} needs PairDPOConfig.{name} (not in this version)")
    if args.fp8 and importlib.util.find_spec("torchao") is None:
        raise SystemExit(
            "--fp8 needs torchao (float8 training): pip install torchao==0.17.0 (the GPU machine installs the carried "
            "wheel from .whl/ through benchmarks/device.sh)"
        )
    return kwargs


class StepClock(TrainerCallback):
    """CUDA sync + wall time at optimizer-step boundaries; opens the profiler regions of the profiled step."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe

    def on_step_begin(self, args, state, control, **kwargs):
        self.probe.sync()
        self.probe.begins.append(time.perf_counter())
        if state.global_step == self.probe.profile_step:
            self.probe.start_profiler()
            self.probe.open_region("bench::step")

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.probe.open_region("bench::optimizer.step")

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.probe.close_region()
        self.probe.open_region("bench::after_optimizer")

    def on_step_end(self, args, state, control, **kwargs):
        self.probe.sync()
        if self.probe.profiling:
            self.probe.stop_profiler()  # trace processing happens here, before this step's end time is taken
        self.probe.ends.append(time.perf_counter())
        if self.probe.progress and state.is_world_process_zero:  # a host print after the sync: nothing timed waits
            print(f"progress: step {state.global_step} {self.probe.ends[-1] - self.probe.begins[-1]:.3f} s, "
                  f"{time.perf_counter() - PROCESS_START:.1f} s since start", flush=True)  # fmt: skip
        if self.probe.count_graphs:
            self.probe.graphs.append(dynamo_graphs())  # a host counter read: no device access


class BenchTrainer(PairDPOTrainer):
    """``PairDPOTrainer`` that records each micro-batch's tokens (host-side, no device access) and marks it."""

    probe: Probe

    def training_step(self, model, inputs, num_items_in_batch=None):
        if isinstance(inputs, StepBatch):  # a budget step: PairDPOTrainer calls this again for each micro-batch
            return super().training_step(model, inputs, num_items_in_batch)
        seqs = inputs.num_sequences
        real = int(inputs.cu_seqlens.numpy()[seqs]) if inputs.cu_seqlens.device.type == "cpu" else inputs.num_tokens
        self.probe.tokens.append((self.state.global_step, real, inputs.num_tokens))
        trl_count = getattr(inputs, "num_unshared_tokens", real)  # each prompt twice, as TRL computes them
        self.probe.trl_tokens.append((self.state.global_step, trl_count))
        self.probe.open_region("bench::microbatch")
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            self.probe.close_region()

    def _clip_grad_norm(self, *args, **kwargs):
        """HF's gradient clipping (transformers >= 5.x calls it per step, when present), marked
        ``hf::clip_grad_norm`` in a profiled step (not a ``bench::`` region, so the sync table still attributes its
        events to ``bench::step``)."""
        self.probe.open_region("hf::clip_grad_norm")
        try:
            return super()._clip_grad_norm(*args, **kwargs)
        finally:
            self.probe.close_region()


def result_row(ctx: dict[str, Any], probe: Probe, trainer: BenchTrainer) -> dict[str, Any]:
    """The ``RESULT`` row: TRL's fields (same names and meaning) plus ours."""
    args = ctx["args"]
    dts, log = timed_tokens(probe, args.warmup)
    steps = len(dts)
    real, padded = sum(x[1] for x in log), sum(x[2] for x in log)
    inner = [e - b for b, e in zip(probe.begins, probe.ends, strict=False)][len(probe.ends) - steps :]
    tok_s = real / sum(dts)
    return {
        **row_head(ctx, trainer, "pair_dpo", tok_s),
        "padding_free_requested": True,
        "padding_free_effective": True,
        "deepspeed": bool(trainer.is_deepspeed_enabled),
        "bs_pairs": ctx["bs"] * args.ga,
        "micro_batch_pairs": None if args.max_tokens_per_microbatch else ctx["bs"],
        "grad_accum": args.ga,
        **budget_fields(args, log, steps),
        "reference_backend": type(trainer.reference).__name__,
        "reference_zero_stage": getattr(trainer.reference_manager.reference_if_built, "zero_stage", None),
        "zero3_leaf_classes": list(getattr(trainer, "zero3_leaf_classes", ())),
        **fsdp_fields(trainer),
        **step_stats(dts),
        "inner_step_median_s": round(statistics.median(inner), 4),
        "real_tokens_per_step": round(real / steps, 1),
        "padded_tokens_per_step": round(padded / steps, 1),
        "microbatch_tokens_mean": round(padded / len(log), 1),
        "microbatch_tokens_max": max(x[2] for x in log),
        "padding_frac": round(1 - real / padded, 4),
        "real_tok_s_gpu_from_median": round(real / steps / statistics.median(dts), 1),
        **layout_fields(trainer, probe, log, real, sum(dts)),
        "n_params": ctx["params"][0],
        "n_params_no_embed": ctx["params"][1],
        "n_params_trainable": ctx["trainable"],
        **resolved_fields(trainer),
        **memory_fields(ctx["cuda"]),
        "train_wall_s": round(ctx["train_wall_s"], 1),
        "setup_wall_s": round(ctx["setup_wall_s"], 1),
        "shapes_first": [[1, x[2]] for x in log[:3]],
        "no_cudnn_sdp": args.no_cudnn_sdp,
        "step_s": [round(d, 3) for d in dts],
        "seq_len": [x[2] for x in log],
        "warmup_step_s": [round(probe.ends[i] - probe.ends[i - 1], 3) for i in range(1, args.warmup)],
        "first_step_s": round(probe.ends[0] - probe.begins[0], 3) if probe.ends else None,
        **(graph_fields(probe.graphs0, probe.graphs, len(probe.ends) - steps) if probe.count_graphs else {}),
        "tf32_matmul": tf32_matmul(),
    }


def layout_fields(
    trainer: BenchTrainer, probe: Probe, log: list[tuple[int, int, int]], real: int, seconds: float
) -> dict[str, Any]:
    """The packed layout that ran and the timed steps' tokens as TRL computes them (each prompt twice) next to the
    tokens packed (``real``): their rate, per step, and the fraction the shared prompt saved."""
    timed = {step for step, _, _ in log}
    trl = sum(count for step, count in probe.trl_tokens if step in timed)
    return {
        "share_prompt": getattr(trainer, "share_prompt", False),
        "unshared_reason": getattr(trainer, "unshared_reason", None),
        "trl_tokens_per_step": round(trl / max(len(timed), 1), 1),
        "trl_tok_s_gpu": round(trl / seconds, 1),
        "prompt_tokens_saved_frac": round(1 - real / trl, 4) if trl else 0.0,
    }


def resolved_fields(trainer: BenchTrainer) -> dict[str, Any]:
    """What ran, read back after training: the trainer's ``activation_checkpointing`` and token budget as the trainer
    left them in ``trainer.args`` (``auto`` may be resolved at start), and whether HF's own per-layer checkpointing
    was on the model (``--gradient-checkpointing``; on transformers 5.24 ``gradient_checkpointing`` is an alias of
    ``TrainingArguments.activation_checkpointing``)."""
    args = trainer.args
    plan = getattr(trainer, "layer_plan", None)  # what ran in the decoder layers (auto resolved at start)
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {
        "config_activation_checkpointing": None if plan is None else plan.checkpointing,
        "auto_checkpointing_fit": None if plan is None or plan.fit is None else plan.fit.describe(),
        "fp8_layers": None if plan is None else plan.fp8_layers,
        "config_max_tokens_per_microbatch": args.max_tokens_per_microbatch,
        "hf_checkpointing_on_model": hf_checkpointing_on(model),
    }


def budget_fields(args: argparse.Namespace, log: list[tuple[int, int, int]], steps: int) -> dict[str, Any]:
    """The mix, the budget options, micro-batches per timed step (mean / max) and the allocator setting."""
    per_step = list(Counter(step for step, _, _ in log).values())
    return {
        "mix": args.mix,
        "max_tokens_per_microbatch": args.max_tokens_per_microbatch,
        "pad_to_budget": args.pad_to_budget,
        "microbatches_per_step_mean": round(len(log) / steps, 2),
        "microbatches_per_step_max": max(per_step),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"),
    }


# --------------------------------------------------------------------------------------------------- main
def setup(args: argparse.Namespace) -> dict[str, Any]:
    """Rank, device and CUDA switches, as the TRL script sets them."""
    ctx = {
        "args": args,
        "rank": int(os.environ.get("RANK", "0")),
        "world": int(os.environ.get("WORLD_SIZE", "1")),
        "cuda": torch.cuda.is_available(),
    }
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    ctx["device"] = torch.device(f"cuda:{local_rank}") if ctx["cuda"] else torch.device("cpu")
    if ctx["cuda"]:
        torch.cuda.set_device(local_rank)
        if args.no_cudnn_sdp:
            torch.backends.cuda.enable_cudnn_sdp(False)
    if args.profile and args.warmup < 1:
        raise SystemExit("--profile needs --warmup >= 1: the profiled step is the last warmup step")
    if args.compile and args.warmup < 1:
        raise SystemExit("--compile needs --warmup >= 1: the graphs are built in the first, untimed, steps")
    return ctx


def build_trainer(ctx: dict[str, Any], probe: Probe) -> BenchTrainer:
    """Model, reference, pairs and the trainer (nothing runs yet)."""
    args = ctx["args"]
    ctx["bs"] = pairs_per_microbatch(args)
    total_steps = args.warmup + args.steps
    vocab = token_vocab(args.model_size)
    pairs = make_pairs((total_steps + 2) * ctx["bs"] * args.ga * ctx["world"], args.seed, args.mix, vocab)
    bf16 = ctx["cuda"] and not args.tiny
    config = build_config(args, ctx["bs"], total_steps, bf16)  # before the model: a refused flag costs no init
    model = build_model(args, ctx["device"])
    ctx["params"] = param_counts(model)  # the base model's (8N convention; LoRA adapters are not counted)
    explicit = args.reference != "free" and args.ref_source == "explicit" and args.lora is None
    ref_model = copy.deepcopy(model) if explicit else None  # LoRA: the trainer's adapter-disabled reference
    if args.lora is not None:
        model = apply_lora(model, args.lora)
    ctx["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    BenchTrainer.probe = probe
    trainer = BenchTrainer(
        model=model,
        args=config,
        train_dataset=pairs,
        processing_class=make_tokenizer(),
        ref_model=ref_model,
        callbacks=[StepClock(probe)],
    )
    print(
        f"benchmarks.dpo: rank {ctx['rank']} of world_size {config.world_size} (WORLD_SIZE={ctx['world']}), "
        f"deepspeed={trainer.is_deepspeed_enabled}, fsdp2={trainer.is_fsdp_enabled}, "
        f"model={args.model_size} ({ctx['params'][0] / 1e6:.1f}M params), "
        f"{ctx['bs']} pairs x {args.ga} micro-batches per step (budget {args.max_tokens_per_microbatch}, mix "
        f"{args.mix}), attn backend {trainer.attn_backend}, "
        f"reference={args.reference}/{args.ref_source} ({type(trainer.reference).__name__}), bf16={bf16}, "
        f"options {option_fields(args)}",
        flush=True,
    )
    return trainer


def write_profile(ctx: dict[str, Any], probe: Probe) -> dict[str, Any]:
    """Writes the sync / top-ops / host-time-by-region summary of the profiled step to stdout and
    ``$OUT/profile_summary.txt``; returns the row fields of the host-time breakdown (``profile_*``)."""
    args = ctx["args"]
    tokens = sum(real for step, real, _padded in probe.tokens if step == probe.profile_step)
    title = (
        f"== profile of optimizer step {probe.profile_step} (0-based, {tokens} real tokens), tag {args.tag}, "
        f"rank {ctx['rank']} =="
    )
    breakdown = profile_summary.host_breakdown(probe.events)
    gaps = profile_summary.idle_gaps(probe.events) if ctx["cuda"] else None
    text = profile_summary.format_summary(probe.events, ctx["cuda"], breakdown, gaps, title=title)
    print(text, flush=True)
    out_dir = os.environ.get("OUT") or (os.path.dirname(args.results) if args.results else None)
    if out_dir:
        suffix = "" if ctx["rank"] == 0 else f".rank{ctx['rank']}"
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        Path(out_dir, f"profile_summary{suffix}.txt").write_text(text)
    return {
        "profile_tokens": tokens,  # the profiled step is a warm-up step: its tokens are not in seq_len
        "profile_step_ms": round(breakdown["step_ms"], 3),
        "profile_host_ms": {r["region"]: round(r["host_ms"], 3) for r in breakdown["rows"]},
        "profile_kernel_ms": round(breakdown["kernel_ms"], 3) if ctx["cuda"] else None,
        "profile_gpu_busy_ms": round(breakdown["busy_ms"], 3) if ctx["cuda"] else None,
        "profile_idle_ms": round(gaps["idle_ms"], 3) if gaps else None,
        "profile_idle_by_region_ms": {r: round(ms, 3) for r, ms in gaps["by_region"].items()} if gaps else None,
    }


def warn_timed_compiles(row: dict[str, Any]) -> None:
    """Prints a WARNING when ``torch.compile`` built graphs during the timed steps of a row."""
    if row.get("dynamo_graphs_timed"):
        print(
            f"WARNING: {row['dynamo_graphs_timed']} torch.compile graph(s) built in TIMED steps ({row['tag']}, "
            f"{row['impl']}): raise --warmup",
            flush=True,
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; returns the RESULT row (with the ceiling row under ``"ceiling"`` when measured)."""
    args = parse_args(argv)
    if args.summarize:
        print(summary_table(args.summarize), flush=True)
        return {}
    ctx = setup(args)
    probe = Probe(ctx["cuda"], args.warmup - 1 if args.profile else None, count_graphs=args.compile)
    probe.progress = args.progress
    _progress(args, "models built")
    trainer = build_trainer(ctx, probe)
    _progress(args, "trainer built")
    if ctx["cuda"]:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    ctx["setup_wall_s"] = start - PROCESS_START  # imports, model, reference identity, trainer: a suite's time budget
    with sampled(ctx["cuda"]) as sampler:
        trainer.train()
    ctx["train_wall_s"] = time.perf_counter() - start
    row = result_row(ctx, probe, trainer)
    row.update(clock_fields(sampler, probe.ends, args.warmup, row["mfu8N_989"]))
    if args.profile and probe.events is not None:
        row.update(write_profile(ctx, probe))
    warn_timed_compiles(row)
    if (args.ceiling or args.ceiling_shape) and (trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled):
        print("CEILING skipped: the raw loop needs whole (unpartitioned) weights, not ZeRO-3 / FSDP2", flush=True)
    else:
        if args.ceiling:
            ceiling = run_ceiling(ctx, trainer)
            ceiling["ours_over_ceiling"] = round(row["real_tok_s_gpu"] / ceiling["real_tok_s_gpu"], 4)
            row["ceiling_real_tok_s_gpu"] = ceiling["real_tok_s_gpu"]
            row["ours_over_ceiling"] = ceiling["ours_over_ceiling"]
            warn_timed_compiles(ceiling)
            emit("CEILING", ceiling, args.results)
            print(f"RATIO ours/ceiling = {ceiling['ours_over_ceiling']:.3f} ({args.tag})", flush=True)
        if args.ceiling_shape:
            shaped = run_shape_ceiling(ctx, trainer)
            shaped["ours_over_ceiling_shape"] = round(row["real_tok_s_gpu"] / shaped["real_tok_s_gpu"], 4)
            row["ceiling_shape"] = shaped["ceiling_shape"]
            row["ceiling_shape_real_tok_s_gpu"] = shaped["real_tok_s_gpu"]
            row["ours_over_ceiling_shape"] = shaped["ours_over_ceiling_shape"]
            warn_timed_compiles(shaped)
            emit("CEILING", shaped, args.results)
            print(
                f"RATIO ours/ceiling{shaped['ceiling_shape']} = {shaped['ours_over_ceiling_shape']:.3f} "
                f"({args.tag}: {row['real_tok_s_gpu']:.0f} vs {shaped['real_tok_s_gpu']:.0f} tok/s)",
                flush=True,
            )
    emit("RESULT", row, args.results)
    return row


if __name__ == "__main__":
    main()
