"""Multi-GPU suites beside the ZeRO-3 ones of ``suites.py``: the DPO defaults and every launch path, NCCL faults,
and the scaling suites (ZeRO-3 and FSDP2 with token-budget micro-batches at DP = 1, 2, 4, 8).

Scaling: every suite runs the same workload: the 1.5B random-init Llama, 32 pairs per GPU per optimizer step packed into
micro-batches of at most 16,384 tokens (GA 1), on the standard (TRL) and the heavy-tailed mix. For each mix, one
GPU without sharding is the denominator (``base_*``, ``CUDA_VISIBLE_DEVICES=0`` in the same call) and the ratios give
the per-GPU throughput of ZeRO-3 with ``ref_zero_stage=0`` and ``=3`` and of FSDP2 as a fraction of it (target
>= 0.90 at the default settings). ``h200-scaling`` is the DP=1 form of the same lines (the sharded runs on one
GPU: their fixed cost, no communication). ``h200x4-large`` / ``h200x8-large`` run an 8B-shape model that does not
fit one GPU with its reference and Adam state (``--model-size 8b``): tokens/s/GPU, MFU and peak memory per rank under
ZeRO-3 and FSDP2.
"""

from __future__ import annotations

from benchmarks.spec import Run, Suite, ours, ratios, train

NC = "--no-cudnn-sdp"
Z3 = "accelerate_configs/zero3.yaml"
FSDP2 = "accelerate_configs/fsdp2.yaml"
BUDGET = ("--bs", "32", "--max-tokens-per-microbatch", "16384")
MIXES = {"std": ("--mix", "trl"), "heavy": ("--mix", "heavy")}
SHARDED = {  # tag part -> (accelerate config, extra flags)
    "z3ref0": (Z3, ("--ref-zero-stage", "0")),
    "z3ref3": (Z3, ("--ref-zero-stage", "3")),
    "fsdp2": (FSDP2, ()),
}
KINDS = {1: "h200-scaling", 2: "h200x2-scaling", 4: "h200x4-scaling", 8: "h200x8-scaling"}


def launch_and_fault_suites() -> tuple[Suite, ...]:
    """``h200x2-launch-paths`` (train.py through every documented launcher) and ``h200x2-nccl-faults``."""
    demo = ("--max_steps", "5", "--logging_steps", "1", "--eval_strategy", "no", "--eval_on_start", "false",
            "--eval_size", "0", "--save_strategy", "no", "--disable_tqdm", "true", "--report_to", "none")  # fmt: skip
    z3j = ("--deepspeed", "accelerate_configs/deepspeed/zero3.json")
    launch = {"timeout_s": 150}
    paths = Suite(
        name="h200x2-launch-paths",
        summary="2x H200: the DPO defaults and every documented launch path (accelerate single / DDP / ZeRO-3, "
        "torchrun + DeepSpeed, the deepspeed launcher) running train.py on the demo",
        gpus=2,
        deadline_s=540,
        env=("OMP_NUM_THREADS=8",),
        runs=(
            Run("defaults", "module", ("benchmarks.checks", "defaults"), timeout_s=60, log="defaults.log"),
            Run(
                "defaults_fp16",
                "module",
                ("benchmarks.checks", "defaults"),
                env=("ACCELERATE_MIXED_PRECISION=fp16",),
                timeout_s=60,
                log="defaults.log",
            ),
            train(
                "single_gpu",
                *demo,
                launcher="accelerate",
                config="accelerate_configs/single_gpu.yaml",
                log="single_gpu.log",
                **launch,
            ),
            train(
                "ddp",
                *demo,
                launcher="accelerate",
                config="accelerate_configs/multi_gpu_ddp.yaml",
                processes=2,
                log="ddp.log",
                **launch,
            ),
            train("zero3_accelerate", *demo, launcher="accelerate", config=Z3, processes=2, log="zero3.log", **launch),
            train("torchrun_deepspeed", *demo, *z3j, launcher="torchrun", processes=2, log="torchrun.log", **launch),
            train("deepspeed_launcher", *demo, *z3j, launcher="deepspeed", processes=2, log="deepspeed.log", **launch),
        ),  # fmt: skip
        look_for="defaults.log: bf16=True mixed_precision=bf16 (bf16=False under fp16); every launch rc=0 with "
        "`pair_dpo: world_size=N` once (1 for single_gpu, 2 for the others); first loss 0.6931",
    )
    faults = Suite(
        name="h200x2-nccl-faults",
        summary="2x H200, NCCL: a stalled rank ends the other within ddp_timeout=30 s; SIGTERM to one rank stops both "
        "after the same step with a checkpoint (exit 75)",
        gpus=2,
        deadline_s=540,
        runs=(
            Run(
                "nccl_faults",
                "module",
                ("pytest", "-q", "-m", "gpu", "tests/test_nccl_faults.py"),
                timeout_s=520,
                log="nccl_faults.log",
            ),
        ),
        look_for='nccl_faults.jsonl: "ok": true on every line; rank0_exit_after_s a little above 30 for the stalls',
    )
    return paths, faults


def _sharded_runs(
    dp: int, suffix: str, model: tuple[str, ...], names: tuple[str, ...], timeout_s: int
) -> tuple[Run, ...]:
    """One ``ours`` run per sharding of :data:`SHARDED` named in ``names``, tagged ``NAME_SUFFIX``, on ``dp`` GPUs."""
    return tuple(
        ours(f"{name}_{suffix}", NC, "--progress", *model, *SHARDED[name][1], launcher="accelerate",
             config=SHARDED[name][0], processes=dp, timeout_s=timeout_s)
        for name in names
    )  # fmt: skip


def _mix_runs(dp: int, mix: str, steps: tuple[str, ...]) -> tuple[Run, ...]:
    model = ("--model-size", "1.5b", *MIXES[mix], *BUDGET, *steps)
    base = ours(f"base_{mix}", NC, "--progress", *model, env=("CUDA_VISIBLE_DEVICES=0",), timeout_s=90)
    return (base, *_sharded_runs(dp, mix, model, tuple(SHARDED), timeout_s=150))


def _large_runs(dp: int) -> tuple[Run, ...]:
    model = ("--model-size", "8b", *MIXES["std"], *BUDGET, "--steps", "4", "--warmup", "2")
    return _sharded_runs(dp, "8b", model, ("z3ref3", "fsdp2"), timeout_s=420)


def scaling_suite(dp: int) -> Suite:
    """The scaling suite of a machine with ``dp`` GPUs (1, 2, 4 or 8)."""
    steps = ("--steps", "6", "--warmup", "3")
    runs = _mix_runs(dp, "heavy", steps) + _mix_runs(dp, "std", steps)
    pairs = [f"{name}_{mix}/base_{mix}" for mix in ("heavy", "std") for name in SHARDED]
    return Suite(
        name=KINDS[dp],
        summary=f"{dp}x H200: 1.5B, 32 pairs/GPU/step in <= 16k-token micro-batches, std and heavy mixes: "
        "ZeRO-3 (ref_zero_stage 0 and 3) and FSDP2 per-GPU throughput as a fraction of one unsharded GPU",
        gpus=dp,
        deadline_s=590,
        env=("OMP_NUM_THREADS=8",),
        runs=runs,
        ratios=ratios(*pairs),
        memory_ratios=ratios(*pairs),
        look_for="RATIO z3ref0_*/base_* etc. >= 0.90 per GPU; rc=0 everywhere; peak GiB per rank in the table",
    )


def large_model_suite(dp: int) -> Suite:
    """The 8B-shape rows on a machine with ``dp`` GPUs (run on the largest kind lent)."""
    return Suite(
        name=f"h200x{dp}-large",
        summary=f"{dp}x H200: an 8B-shape model (does not fit one GPU with its reference and Adam state) "
        "under ZeRO-3 (ref_zero_stage 3) and FSDP2: tokens/s/GPU, MFU (8N), peak memory per rank",
        gpus=dp,
        deadline_s=590,
        env=("OMP_NUM_THREADS=8",),
        runs=_large_runs(dp),
        ratios=ratios("fsdp2_8b/z3ref3_8b"),
        look_for="rc=0 for both; tok/s/GPU, MFU 8N and peak GiB per rank in the table",
    )


SCALING_SUITES = (*(scaling_suite(dp) for dp in KINDS), large_model_suite(4), large_model_suite(8))
