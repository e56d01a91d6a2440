"""Every benchmark suite, as data: the runs (tags, tools, flags, launchers, caps) and the ratios the report prints.

The GPU suites are the former one-off ``scripts/gpu/*.sh`` device calls (same runs, flags, tags, caps and ratios; their
numbers are in docs/benchmarks.md); ``h200-smoke`` and ``cpu-smoke`` are short end-to-end checks of the runner. Order
matters: a suite's deadline skips the runs at the end first, so the lowest-priority runs come last. Add a suite by
adding an entry to :data:`SUITES` (``benchmarks/tests/test_suites.py`` checks every suite's commands on the CPU).
"""

from __future__ import annotations

from benchmarks.multi_gpu import SCALING_SUITES, launch_and_fault_suites
from benchmarks.spec import Curves, Run, Setup, Suite, ours, ratios, train, trl
from benchmarks.speed_suites import SPEED_SUITES

NC = "--no-cudnn-sdp"  # cuDNN SDPA stalls on new shapes (docs/benchmarks.md): off in every GPU suite
PROGRESS = (NC, "--progress")
ONE_GPU = ("CUDA_VISIBLE_DEVICES=0",)
EXPANDABLE = ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",)
Z3 = "accelerate_configs/zero3.yaml"
Z3T = "accelerate_configs/zero3_overlap.yaml"
FSDP2 = "accelerate_configs/fsdp2.yaml"
L15 = ("--model-size", "1.5b", "--steps", "10", "--warmup", "3")

# ZeRO-3 train.py checks: a random ~0.5B Llama written as a pinned snapshot, and the flags those checks share.
RANDOM_05B = Setup("random_model", "model05b", ("--hidden", "1024", "--layers", "24", "--intermediate", "5632",
                                                 "--heads", "16"))  # fmt: skip
CHECK_ARGS = (
    "--model_name_or_path", "{model05b}", "--ref_model_revision", "{rev}", "--bf16", "true", "--learning_rate",
    "5e-5", "--lr_scheduler_type", "cosine", "--warmup_steps", "5", "--logging_steps", "1", "--max_length", "128",
    "--max_prompt_length", "64", "--seed", "0", "--report_to", "none", "--disable_tqdm", "true",
)  # fmt: skip


def _z3_train(tag: str, procs: int, steps: str, *extra: str, timeout_s: int = 120) -> Run:
    """A ZeRO-3 ``train.py`` check run (DP=1: 16 pairs x GA 2; DP=2: 8 pairs x GA 2 per rank)."""
    bs = "16" if procs == 1 else "8"
    args = (*CHECK_ARGS, *steps.split(), "--per_device_train_batch_size", bs, "--gradient_accumulation_steps", "2")
    return train(tag, *args, *extra, launcher="accelerate", config=Z3, processes=procs, timeout_s=timeout_s,
                 log="train.log")  # fmt: skip


DP_CURVES = Curves(("dp1_std", "dp2_std"), ("DP=1", "DP=2"), "dp1_vs_dp2.png")
STEPS10 = "--max_steps 10 --eval_steps 10 --save_steps 10 --save_total_limit 1"
DP1_VS_DP2 = (_z3_train("dp1_std", 1, STEPS10, timeout_s=110), _z3_train("dp2_std", 2, STEPS10, timeout_s=110))


def _smoke() -> tuple[Suite, ...]:
    cpu = Suite(
        name="cpu-smoke",
        summary="CPU: ours and TRL (when installed) on the tiny model, 1 timed step each; checks the runner itself",
        gpus=0,
        deadline_s=300,
        runs=(
            ours("ours_tiny", "--tiny", "--steps", "1", "--warmup", "1", "--ceiling", timeout_s=150),
            trl("trl_tiny", "--tiny", "--steps", "1", "--warmup", "1", "--bs", "2", "--workers", "0", timeout_s=150),
        ),
        ratios=ratios("ours_tiny/trl_tiny", "ours_tiny/ours_tiny:pair_dpo_ceiling"),
        look_for="rc=0 for ours_tiny; a RESULT row per run; trl_tiny SKIPPED unless trl is installed",
    )
    h200 = Suite(
        name="h200-smoke",
        summary="1x H200, < 5 min: TRL and ours on the 254M workload (10 timed steps), ours' packed ceiling",
        gpus=1,
        deadline_s=280,
        env=ONE_GPU,
        runs=(
            trl("trl_sdpa", "--attn", "sdpa", "--no_cudnn_sdp", "--steps", "10", "--warmup", "3", timeout_s=100),
            ours("ours", NC, "--steps", "10", "--warmup", "3", "--ceiling", timeout_s=100),
            ours("ours_tiny", "--tiny", timeout_s=60),
        ),
        ratios=ratios("ours/trl_sdpa", "ours/ours:pair_dpo_ceiling"),
        look_for="rc=0 for every run; RATIO ours/trl_sdpa near the 1.85-1.90x of docs/benchmarks.md's eager 254M rows",
    )
    return cpu, h200


def _one_gpu() -> tuple[Suite, ...]:
    shape = ("--ceiling", "--ceiling-shape", "16x1024")
    l15 = ("--model-size", "1.5b", "--steps", "15", "--warmup", "4")
    pytest_flags = ("-q", "-s", "-p", "no:cacheprovider")
    packed = Suite(
        name="h200-packed",
        summary="1x H200: GPU tests of the packed path, TRL vs ours (254M, 1.5B, ~16k-token micro-batches), profile",
        gpus=1,
        deadline_s=590,
        env=ONE_GPU,
        runs=(
            Run(
                "gpu_tests",
                "pytest",
                (*pytest_flags, "tests/test_gpu_packed.py", "tests/test_collators.py"),
                timeout_s=110,
                log="gpu_tests.log",
            ),
            trl("trl_sdpa", "--attn", "sdpa", "--no_cudnn_sdp", timeout_s=90, log="trl.log"),
            ours("ours", NC, "--ceiling", timeout_s=80),
            ours("ours_prof", NC, "--profile", "--steps", "3", "--warmup", "3", timeout_s=60, log="ours_prof.log"),
            ours("ours_precomputed", NC, "--reference", "precomputed", "--steps", "15", timeout_s=60),
            ours("ours_1p5b", NC, "--model-size", "1.5b", "--ceiling", "--steps", "20", "--warmup", "3", timeout_s=90),
            ours(
                "ours_1p5b_16k",
                NC,
                "--model-size",
                "1.5b",
                "--bs-for-tokens",
                "16384",
                "--ceiling",
                "--steps",
                "15",
                "--warmup",
                "3",
                timeout_s=90,
            ),
        ),  # fmt: skip
        ratios=ratios("ours/trl_sdpa", "ours/ours:pair_dpo_ceiling", "ours_precomputed/ours"),
    )
    compiled = Suite(
        name="h200-compile",
        summary="1x H200: GPU tests, TRL, ours eager vs --compile with both ceilings (16x1024), profile, 1.5B",
        gpus=1,
        deadline_s=545,
        env=ONE_GPU,
        runs=(
            Run("gpu_tests", "pytest", (*pytest_flags, "-m", "gpu", "tests/"), timeout_s=120, log="env_and_tests.log"),
            trl("trl_sdpa", "--attn", "sdpa", "--no_cudnn_sdp", timeout_s=90, log="trl.log"),
            ours("ours_eager", NC, *shape, timeout_s=80, log="ours_254m.log"),
            ours("ours_compile", NC, "--compile", *shape, timeout_s=150, log="ours_254m.log"),
            ours(
                "ours_compile_prof",
                NC,
                "--compile",
                "--profile",
                "--steps",
                "3",
                "--warmup",
                "4",
                timeout_s=90,
                log="ours_prof.log",
            ),
            ours(
                "ours_compile_precomputed",
                NC,
                "--compile",
                "--reference",
                "precomputed",
                "--steps",
                "20",
                timeout_s=80,
                log="ours_254m.log",
            ),
            ours("ours_1p5b_eager", NC, *l15, "--ceiling", timeout_s=90, log="ours_1p5b.log"),
            ours("ours_1p5b_compile", NC, *l15, "--compile", "--ceiling", timeout_s=120, log="ours_1p5b.log"),
            ours(
                "ours_1p5b_16k_compile",
                NC,
                *l15,
                "--compile",
                "--ceiling",
                "--bs-for-tokens",
                "16384",
                timeout_s=120,
                log="ours_1p5b.log",
            ),
        ),  # fmt: skip
        ratios=ratios(
            "ours_compile/ours_eager",
            "ours_compile/trl_sdpa",
            "ours_eager/trl_sdpa",
            "ours_compile/ours_compile_ceiling16x1024:pair_dpo_ceiling_shape",
            "ours_compile/ours_eager_ceiling16x1024:pair_dpo_ceiling_shape",
            "ours_compile_ceiling16x1024:pair_dpo_ceiling_shape/ours_eager_ceiling16x1024:pair_dpo_ceiling_shape",
            "ours_compile/ours_compile:pair_dpo_ceiling",
            "ours_1p5b_compile/ours_1p5b_compile:pair_dpo_ceiling",
            "ours_compile_precomputed/ours_compile",
            "ours_1p5b_compile/ours_1p5b_eager",
            "ours_1p5b_16k_compile/ours_1p5b_16k_compile:pair_dpo_ceiling",
        ),  # fmt: skip
        look_for="target: ours_compile >= 110k tok/s; 0 dynamo_graphs_timed",
    )
    return packed, compiled


def _token_budget() -> Suite:
    heavy = ("--model-size", "1.5b", "--mix", "heavy", "--steps", "4", "--warmup", "2")
    std = ("--model-size", "1.5b", "--steps", "4", "--warmup", "2")
    b16k, ga4 = ("--bs", "32", "--max-tokens-per-microbatch", "16384"), ("--bs", "8", "--ga", "4")
    small = ("--compile", "--bs", "32", "--max-tokens-per-microbatch", "12288", "--steps", "8", "--warmup", "3")
    x = EXPANDABLE
    return Suite(
        name="h200-token-budget",
        summary="1x H200: token-budget micro-batches vs fixed GA on the heavy and TRL mixes, padded to the "
        "budget, expandable_segments on/off, compiled budget vs its ceiling, the CUDA-graph probe",
        gpus=1,
        deadline_s=470,
        env=ONE_GPU,
        runs=(
            ours("heavy_b16k", NC, *heavy, *b16k, env=x, timeout_s=75, log="heavy.log"),
            ours("heavy_ga4", NC, *heavy, *ga4, env=x, timeout_s=75, log="heavy.log"),
            ours("heavy_b16k_pad", NC, *heavy, *b16k, "--pad-to-budget", env=x, timeout_s=75, log="heavy.log"),
            ours("std_b16k", NC, *std, *b16k, env=x, timeout_s=60, log="std.log"),
            ours("std_ga4", NC, *std, *ga4, env=x, timeout_s=60, log="std.log"),
            ours(
                "std_b16k_compile",
                NC,
                "--model-size",
                "1.5b",
                "--steps",
                "4",
                "--warmup",
                "3",
                *b16k,
                "--compile",
                "--ceiling",
                env=x,
                timeout_s=120,
                log="compile.log",
            ),
            trl(
                "trl_sdpa",
                "--attn",
                "sdpa",
                "--no_cudnn_sdp",
                "--steps",
                "15",
                "--warmup",
                "3",
                timeout_s=70,
                log="trl.log",
            ),
            ours("small_b12k_pad", NC, *small, "--pad-to-budget", env=x, timeout_s=60, log="small.log"),
            ours("small_b12k", NC, *small, env=x, timeout_s=60, log="small.log"),
            ours(
                "heavy_b16k_noexp", NC, *heavy, *b16k, env=("-PYTORCH_CUDA_ALLOC_CONF",), timeout_s=75, log="heavy.log"
            ),
            Run("probe", "module", ("benchmarks.cudagraph_probe", "--budget", "4096"), timeout_s=45, log="probe.log"),
            ours(
                "small_8pairs", NC, "--compile", "--steps", "15", "--warmup", "3", env=x, timeout_s=50, log="small.log"
            ),
        ),  # fmt: skip
        ratios=ratios(
            "heavy_b16k/heavy_ga4",
            "std_b16k/std_ga4",
            "heavy_b16k/heavy_b16k_noexp",
            "std_b16k_compile/std_b16k_compile:pair_dpo_ceiling",
            "std_b16k_compile/std_b16k",
            "small_b12k_pad/trl_sdpa",
            "small_b12k/trl_sdpa",
            "small_8pairs/trl_sdpa",
            "small_b12k_pad/small_b12k",
        ),  # fmt: skip
        memory_ratios=ratios("heavy_b16k/heavy_b16k_pad", "heavy_ga4/heavy_b16k_pad", "heavy_b16k_noexp/heavy_b16k"),
    )


def _fsdp2() -> Suite:
    bench = (NC, "--steps", "15", "--warmup", "3")
    fsdp = {"launcher": "accelerate", "config": FSDP2, "processes": 1}
    demo = ("--bf16", "true", "--max_steps", "20", "--save_steps", "10", "--eval_steps", "10", "--logging_steps", "1",
            "--report_to", "none", "--disable_tqdm", "true")  # fmt: skip
    return Suite(
        name="h200-fsdp2",
        summary="1x H200: FSDP2 at world size 1 beside the non-FSDP run; train.py under FSDP2 and its "
        "resume from checkpoint-10; a compiled FSDP2 run with the time left",
        gpus=1,
        deadline_s=250,
        env=(*ONE_GPU, "OMP_NUM_THREADS=8"),
        runs=(
            ours("base_254m", *bench, timeout_s=60),
            ours("fsdp2_254m", *bench, timeout_s=75, **fsdp),
            ours("fsdp2_254m_refrep", *bench, "--ref-fsdp-shard", "false", timeout_s=75, **fsdp),
            train("demo", *demo, timeout_s=90, log="train.log", **fsdp),
            train(
                "demo_resume",
                *demo,
                "--resume_from_checkpoint",
                "{work}/demo/checkpoint-10",
                timeout_s=90,
                log="train.log",
                **fsdp,
            ),  # fmt: skip
            ours("fsdp2_254m_compile", *bench, "--compile", timeout_s=120, **fsdp),
        ),
        ratios=ratios(
            "fsdp2_254m/base_254m",
            "fsdp2_254m_refrep/base_254m",
            "fsdp2_254m_refrep/fsdp2_254m",
            "fsdp2_254m_compile/fsdp2_254m",
        ),  # fmt: skip
        curves=(Curves(("demo", "demo_resume"), ("straight", "resumed"), "fsdp2_resume.png"),),
        look_for="resume: largest loss difference of steps 11-20 ~0 (bf16 noise); first eval_loss 0.6931",
    )


def _zero3_throughput() -> tuple[Suite, ...]:
    k16 = ("--model-size", "1.5b", "--bs-for-tokens", "16384", "--steps", "6", "--warmup", "3")
    z3 = {"launcher": "accelerate", "config": Z3, "processes": 2}
    z3t = {"launcher": "accelerate", "config": Z3T, "processes": 2}
    r0 = ("--ref-zero-stage", "0")
    throughput = Suite(
        name="h200x2-zero3-throughput",
        summary="2x H200: the 1.5B model under ZeRO-3 (auto buckets; zero3_overlap + ref_zero_stage=0; no leaf "
        "layers) vs 1 GPU eager at 8 pairs and ~16k-token micro-batches; 254M under ZeRO-3 vs 1 GPU",
        gpus=2,
        deadline_s=545,
        env=("OMP_NUM_THREADS=8",),
        runs=(
            ours("ours_1gpu_1p5b", *PROGRESS, *L15, env=ONE_GPU, timeout_s=60, log="ours_1p5b.log"),
            ours("ours_z3_1p5b", *PROGRESS, *L15, timeout_s=110, log="ours_1p5b.log", **z3),
            ours("ours_z3tuned_1p5b", *PROGRESS, *L15, *r0, "--profile", timeout_s=110, log="ours_1p5b.log", **z3t),
            ours(
                "ours_z3tuned_noleaf_1p5b",
                *PROGRESS,
                *L15,
                *r0,
                "--zero3-leaf-modules",
                "none",
                timeout_s=110,
                log="ours_1p5b.log",
                **z3t,
            ),
            ours("ours_z3tuned_1p5b_16k", *PROGRESS, *k16, *r0, timeout_s=100, log="ours_1p5b.log", **z3t),
            ours("ours_1gpu_1p5b_16k", *PROGRESS, *k16, env=ONE_GPU, timeout_s=60, log="ours_1p5b.log"),
            ours(
                "ours_1gpu_compile_254m",
                *PROGRESS,
                "--compile",
                "--steps",
                "20",
                "--warmup",
                "5",
                env=ONE_GPU,
                timeout_s=50,
                log="ours_254m.log",
            ),
            ours(
                "ours_z3tuned_254m",
                *PROGRESS,
                "--steps",
                "8",
                "--warmup",
                "3",
                *r0,
                timeout_s=70,
                log="ours_254m.log",
                **z3t,
            ),
            ours(
                "ours_1gpu_254m",
                *PROGRESS,
                "--steps",
                "20",
                "--warmup",
                "5",
                env=ONE_GPU,
                timeout_s=40,
                log="ours_254m.log",
            ),
            ours("ours_z3_254m", *PROGRESS, "--steps", "8", "--warmup", "3", timeout_s=70, log="ours_254m.log", **z3),
        ),  # fmt: skip
        ratios=ratios(
            "ours_z3_1p5b/ours_1gpu_1p5b",
            "ours_z3tuned_1p5b/ours_1gpu_1p5b",
            "ours_z3tuned_noleaf_1p5b/ours_1gpu_1p5b",
            "ours_z3tuned_1p5b/ours_z3tuned_noleaf_1p5b",
            "ours_z3tuned_1p5b_16k/ours_1gpu_1p5b_16k",
            "ours_z3tuned_254m/ours_1gpu_compile_254m",
            "ours_z3tuned_254m/ours_1gpu_254m",
            "ours_z3_254m/ours_1gpu_254m",
        ),  # fmt: skip
    )
    steps = Suite(
        name="h200x2-zero3-steps",
        summary="2x H200: the ZeRO-3 runs with few steps, generous caps and --progress (per-step times on rank 0)",
        gpus=2,
        deadline_s=420,
        env=("OMP_NUM_THREADS=8",),
        runs=(
            ours(
                "ours_z3tuned_1p5b",
                *PROGRESS,
                "--model-size",
                "1.5b",
                "--steps",
                "3",
                "--warmup",
                "1",
                *r0,
                timeout_s=170,
                log="z3.log",
                **z3t,
            ),
            ours(
                "ours_z3_1p5b",
                *PROGRESS,
                "--model-size",
                "1.5b",
                "--steps",
                "3",
                "--warmup",
                "1",
                timeout_s=150,
                log="z3.log",
                **z3,
            ),
            ours("ours_z3_254m", *PROGRESS, "--steps", "4", "--warmup", "2", timeout_s=90, log="z3.log", **z3),
        ),  # fmt: skip
    )
    return throughput, steps


def _zero3_variants() -> tuple[Suite, ...]:
    z3t = {"launcher": "accelerate", "config": Z3T, "processes": 2}
    plain = {"launcher": "accelerate", "config": "{zero3_plainlinear}", "processes": 2}
    k16 = ("--model-size", "1.5b", "--bs-for-tokens", "16384", "--steps", "8", "--warmup", "3")
    r0 = ("--ref-zero-stage", "0")
    log = {"log": "ours_1p5b.log"}
    linear = Suite(
        name="h200x2-zero3-linear",
        summary="2x H200: 1.5B, leaf layers, zero3_overlap + ref_zero_stage=0, DeepSpeed's memory_efficient_linear on "
        "(default) and off, at 8 pairs and ~16k-token micro-batches, vs 1 GPU eager",
        gpus=2,
        deadline_s=420,
        env=("OMP_NUM_THREADS=8",),
        setup=(Setup("zero3_variant", "zero3_plainlinear", ("memory_efficient_linear", "false")),),
        runs=(
            ours("ours_1gpu_1p5b", *PROGRESS, *L15, env=ONE_GPU, timeout_s=50, **log),
            ours("ours_z3plain_1p5b", *PROGRESS, *L15, *r0, timeout_s=80, **log, **plain),
            ours("ours_z3tuned_1p5b", *PROGRESS, *L15, *r0, timeout_s=80, **log, **z3t),
            ours("ours_1gpu_1p5b_16k", *PROGRESS, *k16, env=ONE_GPU, timeout_s=50, **log),
            ours("ours_z3tuned_1p5b_16k", *PROGRESS, *k16, *r0, timeout_s=80, **log, **z3t),
            ours("ours_z3plain_1p5b_16k", *PROGRESS, *k16, *r0, timeout_s=80, **log, **plain),
        ),
        ratios=ratios(
            "ours_z3tuned_1p5b/ours_1gpu_1p5b",
            "ours_z3plain_1p5b/ours_1gpu_1p5b",
            "ours_z3tuned_1p5b_16k/ours_1gpu_1p5b_16k",
            "ours_z3plain_1p5b_16k/ours_1gpu_1p5b_16k",
        ),  # fmt: skip
    )
    persist = {"launcher": "accelerate", "config": "{zero3_persist}", "processes": 2}
    leaf = Suite(
        name="h200x2-zero3-leaf-check",
        summary="2x H200: 1.5B with leaf decoder layers (zero3_overlap + ref_zero_stage=0) and with every layer weight "
        "persistent, vs 1 GPU eager; then DP=1 vs DP=2 loss curves under ZeRO-3 (train.py, 10 steps)",
        gpus=2,
        deadline_s=560,
        env=("OMP_NUM_THREADS=8",),
        setup=(Setup("zero3_variant", "zero3_persist", ("stage3_param_persistence_threshold", "12000000")), RANDOM_05B),
        runs=(
            ours("ours_1gpu_1p5b", *PROGRESS, *L15, env=ONE_GPU, timeout_s=50, **log),
            ours("ours_z3tuned_1p5b", *PROGRESS, *L15, *r0, timeout_s=90, **log, **z3t),
            ours("ours_z3persist_1p5b", *PROGRESS, *L15, *r0, timeout_s=90, **log, **persist),
            *DP1_VS_DP2,
        ),
        ratios=ratios("ours_z3tuned_1p5b/ours_1gpu_1p5b", "ours_z3persist_1p5b/ours_1gpu_1p5b"),
        curves=(DP_CURVES,),
    )
    return linear, leaf


def _zero3_train() -> tuple[Suite, ...]:
    dp = Suite(
        name="h200x2-zero3-dp1-vs-dp2",
        summary="2x H200: DP=1 vs DP=2 loss curves under ZeRO-3, 10 steps (docs/zero3_howto.md)",
        gpus=2,
        deadline_s=300,
        env=("OMP_NUM_THREADS=8",),
        setup=(RANDOM_05B,),
        runs=DP1_VS_DP2,
        curves=(DP_CURVES,),
        look_for="the largest |loss difference| DP=1 vs DP=2 (bf16 noise)",
    )
    steps50 = "--max_steps 50 --eval_steps 50 --save_steps 25 --save_total_limit 4"
    long = Suite(
        name="h200x2-zero3-50steps",
        summary="2x H200: ZeRO-3 DP=1 vs DP=2, precomputed reference, resume at 25, 50 steps (each run capped at "
        "120 s), then ours under ZeRO-3 with the trainer-built reference",
        gpus=2,
        deadline_s=590,
        env=("OMP_NUM_THREADS=8",),
        setup=(RANDOM_05B,),
        runs=(
            _z3_train("dp1_std", 1, steps50),
            _z3_train("dp2_std", 2, steps50),
            _z3_train("dp2_pre", 2, steps50, "--precompute_ref_log_probs", "true"),
            _z3_train("dp2_resume", 2, steps50, "--resume_from_checkpoint", "{work}/dp2_std/checkpoint-25"),
            ours("ours_z3", NC, "--ref-source", "trainer", launcher="accelerate", config=Z3, processes=2, timeout_s=80),
        ),
        curves=(
            DP_CURVES,
            Curves(
                ("dp2_std", "dp2_pre", "dp2_resume"),
                ("online reference", "precomputed", "resumed at 25"),
                "zero3_online_precomputed_resume.png",
            ),
        ),  # fmt: skip
    )
    return dp, long


def _objectives() -> Suite:
    return Suite(
        name="h200-losses",
        summary="1x H200: the objectives' GPU checks (chunked-head per-token statistics: cost and values; every "
        "objective trains 3 bf16 steps), then ours' default 254M row, whose step time includes the statistics",
        gpus=1,
        deadline_s=540,
        env=ONE_GPU,
        runs=(
            Run(
                "gpu_losses",
                "pytest",
                ("-q", "-s", "-p", "no:cacheprovider", "-m", "gpu", "tests/test_gpu_losses.py"),
                timeout_s=300,
                log="gpu_losses.log",
            ),
            ours("ours_stats", NC, "--steps", "15", timeout_s=150),
        ),  # fmt: skip
        look_for="gpu_losses.log: every test passed ([gpu] lines give the statistics' cost); ours_stats rc=0",
    )


def _data_scale() -> tuple[Suite, Suite]:
    """The data-at-scale targets on the GPU machine's 16 cores (CPU work only: no GPU is touched): prepare-data's
    speed-up,
    then the trainer's memory per rank with 1M raw pairs."""

    def step(tag: str, timeout_s: int, *args: str) -> Run:
        bench = ("benchmarks.bench_data_scale", "--results", "{out}/data_scale.jsonl")
        return Run(tag, "module", (*bench, *args), timeout_s=timeout_s, log="data_scale.log")

    prepare = ("prepare", "--repeats", "1", "--tmp", "{work}", "--num-proc")
    speed = Suite(
        name="h200-data-scale",
        summary="16 CPU cores of the 1x H200 machine: prepare-data with the bundled tokenizer, 1, 2, 4, 8 and 16 "
        "workers on the same 200k rows (target 16 >= 10x 1, same output hashes), then 16 workers on 1M rows (target "
        "< 120 s)",
        gpus=1,
        deadline_s=420,
        env=("OMP_NUM_THREADS=1",),
        runs=(
            step("input_200k", 30, "make-input", "--rows", "200000", "--out", "{work}/rows_200k.jsonl"),
            step("input_1m", 40, "make-input", "--rows", "1000000", "--out", "{work}/rows_1m.jsonl"),
            step("prepare_200k", 240, *prepare, "1", "2", "4", "8", "16", "--input", "{work}/rows_200k.jsonl"),
            step("prepare_1m", 120, *prepare, "16", "--input", "{work}/rows_1m.jsonl"),
        ),
        look_for="data_scale.log: `RATIO best-of-1: 16 workers = N x 1 worker(s) (200000 rows ...)` with N >= 10 and "
        "`SAME_OUTPUTS True (5 runs)`; the 1M run's RATIO line gives its seconds (target < 120 s); phases and CPU "
        "per process in data_scale.jsonl",
    )
    trainer = Suite(
        name="h200-data-trainer",
        summary="16 CPU cores of the 1x H200 machine: 2 CPU ranks (torchrun, gloo) build PairDPOTrainer on 1k and "
        "on 1M raw pairs of ~800 tokens (16 tokenising workers on the local main) and train 3 steps; peak RSS per "
        "rank (target: 1M <= 1k + 1.5 GB), tokenising CPU per rank (once per node)",
        gpus=1,
        deadline_s=560,
        env=("OMP_NUM_THREADS=1",),
        runs=(
            step(
                "trainer_1k_1m",
                540,
                "trainer",
                "--pairs",
                "1000",
                "1000000",
                "--tokens",
                "800",
                "--num-proc",
                "16",
                "--steps",
                "3",
                "--tmp",
                "{work}",
            ),
        ),  # fmt: skip
        look_for="data_scale.jsonl: `bench: trainer` records, one per rank and pair count: run_peak_mib of 1M vs 1k "
        "on each rank, build_cpu_workers_s on rank 0 only, cache_created_by_pid equal on both ranks",
    )
    return speed, trainer


SUITES: dict[str, Suite] = {
    s.name: s
    for s in (
        *_smoke(),
        *_one_gpu(),
        _token_budget(),
        _fsdp2(),
        *_zero3_throughput(),
        *_zero3_variants(),
        *_zero3_train(),
        *launch_and_fault_suites(),
        _objectives(),
        *_data_scale(),
        *SCALING_SUITES,
        *SPEED_SUITES,
    )
}
