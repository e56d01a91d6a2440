"""1x H200 suites of the larger shapes and the memory options, each one device call of at most 9 minutes: the
Qwen2-1.5B shape (ours vs TRL + liger, ceiling, profile, fp8), the 8B model on one GPU (activation checkpointing
settings, fp8, LoRA, vs TRL), the allocator as a library user gets it, and the GPU tests.

Order is priority: the runner's deadline skips runs from the end, so ours' main rows come first and TRL's after
ours (TRL is the peer). A run that fails (an OOM of ``--activation-checkpointing off`` on 8B, a flag this version
of the package refuses) prints its ``rc`` and the suite goes on. ``h200-speed-8b-trl`` repeats the 8B comparison
rows (ours' denominators and TRL) for a second call when the first one's deadline cut TRL's runs.
"""

from __future__ import annotations

from benchmarks.spec import Run, Suite, ours, ratios, trl

NC = "--no-cudnn-sdp"  # ours; TRL's spelling is --no_cudnn_sdp (cuDNN SDPA stalls on new padded shapes)
ONE_GPU = ("CUDA_VISIBLE_DEVICES=0",)
EXPANDABLE = ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",)  # what train.py sets; both sides get it
NO_ALLOC_CONF = ("-PYTORCH_CUDA_ALLOC_CONF", "-PYTORCH_ALLOC_CONF")

QWEN = ("--model-size", "qwen1.5b", "--warmup", "3", "--steps", "8")  # 8 pairs per step (the default --bs)
B8 = ("--model-size", "8b", "--warmup", "3", "--steps", "5")
TRL_B8 = ("--model-size", "8b", "--no_cudnn_sdp", "--warmup", "2", "--steps", "4")  # no compile: fewer warmup steps

GPU_TESTS = Run(
    "gpu_tests",
    "pytest",
    ("-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/"),
    timeout_s=180,
    log="gpu_tests.log",
)
"""Every GPU test of the repository (``-m gpu``; the 2-GPU ones skip on one GPU)."""


def speed_qwen() -> Suite:
    """``h200-speed-qwen``: the Qwen2-1.5B shape, 8 pairs per step, compiled."""
    trl_args = ("--model-size", "qwen1.5b", "--no_cudnn_sdp", "--warmup", "3", "--steps", "8")
    return Suite(
        name="h200-speed-qwen",
        summary="1x H200: the Qwen2-1.5B shape (tied head, QKV bias), 8 pairs/step: ours compiled with its ceiling "
        "and a profiled step, ours with fp8 (tensorwise), TRL + liger (TRL's best setting), TRL plain",
        gpus=1,
        deadline_s=540,
        env=(*ONE_GPU, *EXPANDABLE),
        runs=(
            ours("ours_qwen", NC, *QWEN, "--compile", "--ceiling", "--profile", timeout_s=170, log="ours.log"),
            ours("ours_qwen_fp8", NC, *QWEN, "--compile", "--fp8", "tensorwise", timeout_s=170, log="ours.log"),
            trl("trl_qwen_liger", *trl_args, "--liger", timeout_s=120, log="trl.log"),
            trl("trl_qwen", *trl_args, timeout_s=120, log="trl.log"),
        ),
        ratios=ratios(
            "ours_qwen/trl_qwen_liger",
            "ours_qwen/ours_qwen:pair_dpo_ceiling",
            "ours_qwen_fp8/ours_qwen",
            "ours_qwen/trl_qwen",
            "trl_qwen_liger/trl_qwen",
        ),
        memory_ratios=ratios("ours_qwen/trl_qwen_liger", "ours_qwen_fp8/ours_qwen"),
        look_for="rc=0 for every run (trl_qwen_liger: a LIGER_MISSING line means the liger wheel did not import); "
        "RATIO ours_qwen/trl_qwen_liger (the headline), ours_qwen/ours_qwen:pair_dpo_ceiling near 0.93-0.97 as the "
        "1.5B Llama rows, ours_qwen_fp8/ours_qwen (NOTES: marginal at this width: k/v stay bf16); 0 "
        "dynamo_graphs_timed; ours.log: the profile's 'Host wall time per step by region' table (launch/host-bound "
        "or not) and MFU 8N of the three sides; fp8 row: fp8 'tensorwise' and its peak GiB ~ bf16's",
    )


def _ours_8b() -> tuple[Run, ...]:
    """Ours on 8B, compiled, by priority: the expected-best checkpointing setting (every 2nd layer), fp8 on the same
    setting, LoRA (no checkpointing: the frozen base needs no gradients or Adam state), the auto setting, the others."""

    def run(tag: str, *flags: str, timeout_s: int = 150) -> Run:  # a generous cap: a killed run leaves no row
        return ours(tag, NC, *B8, "--compile", *flags, timeout_s=timeout_s, log="ours_8b.log")

    ac = "--activation-checkpointing"
    return (
        run("ours_8b_l2", ac, "layers:2"),
        run("ours_8b_fp8", ac, "layers:2", "--fp8", "tensorwise", timeout_s=170),
        run("ours_8b_lora16", "--lora", "16"),
        run("ours_8b_auto", ac, "auto", "--max-tokens-per-microbatch", "16384", timeout_s=170),
        run("ours_8b_selective", ac, "selective"),
        run("ours_8b_off", ac, "off"),  # may OOM (~10k tokens fit by the estimate; steps reach ~12k)
        run("ours_8b_full", ac, "full"),
    )


def _trl_8b() -> tuple[Run, ...]:
    """TRL on 8B: full fine-tune with gradient checkpointing and liger, LoRA with gradient checkpointing, and the full
    fine-tune without liger (the denominator when liger does not run)."""
    gc = "--gradient-checkpointing"
    return (
        trl("trl_8b_gc_liger", *TRL_B8, gc, "--liger", timeout_s=130, log="trl_8b.log"),
        trl("trl_8b_lora16_gc", *TRL_B8, "--lora", "16", gc, timeout_s=130, log="trl_8b.log"),
        trl("trl_8b_gc", *TRL_B8, gc, timeout_s=130, log="trl_8b.log"),
    )


TRL_8B_RATIOS = ("ours_8b_l2/trl_8b_gc_liger", "ours_8b_l2/trl_8b_gc", "ours_8b_lora16/trl_8b_lora16_gc")
LOOK_8B = (
    "peak_alloc_gib / peak_reserved_gib of every row (the table and the MEM lines); which checkpointing rows ran "
    "(rc, OOM tracebacks in ours_8b.log: ours_8b_off may OOM) and the fastest that fits (RATIO ours_8b_*/ours_8b_l2; "
    "if it is not layers:2, fp8 was measured on the wrong setting: rerun ours_8b_fp8 with it); ours_8b_auto's "
    "config_activation_checkpointing (what auto chose) and its speed against the fixed settings; RATIO "
    "ours_8b_fp8/ours_8b_l2 (torchao's Llama3-8B figure: ~1.2x with compile); RATIO ours_8b_l2/trl_8b_gc_liger and "
    "ours_8b_lora16/trl_8b_lora16_gc (TRL rows: trl_liger, liger_modules > 0, hf_checkpointing_on_model); MFU 8N "
    "(LoRA rows: 8N counts weight gradients LoRA does not compute, compare tok/s); SKIPPED (deadline) lines: run "
    "h200-speed-8b-trl for what was cut"
)


def speed_8b() -> tuple[Suite, Suite]:
    """``h200-speed-8b`` (every 8B row) and ``h200-speed-8b-trl`` (the comparison rows only, for a second call)."""
    ours_runs, trl_runs = _ours_8b(), _trl_8b()
    ac_ratios = tuple(f"{r.tag}/ours_8b_l2" for r in ours_runs if r.tag not in ("ours_8b_l2", "ours_8b_lora16"))
    full = Suite(
        name="h200-speed-8b",
        summary="1x H200: the 8B model on ONE GPU (bf16 weights and AdamW states, bf16 reference: ~75 GiB static), "
        "8 pairs/step, compiled: activation checkpointing every 2nd layer / auto / selective / off / full, fp8, "
        "LoRA 16; then TRL with gradient checkpointing (+ liger) and TRL LoRA 16",
        gpus=1,
        deadline_s=540,
        env=(*ONE_GPU, *EXPANDABLE),
        runs=(*ours_runs, *trl_runs),
        ratios=ratios(*TRL_8B_RATIOS, *ac_ratios, "ours_8b_lora16/ours_8b_l2"),
        memory_ratios=ratios(*TRL_8B_RATIOS, *ac_ratios),
        look_for=LOOK_8B,
    )
    by_tag = {r.tag: r for r in ours_runs}
    peers = Suite(
        name="h200-speed-8b-trl",
        summary="1x H200: the 8B comparison rows of h200-speed-8b alone (ours every-2nd-layer checkpointing and "
        "LoRA 16, TRL with gradient checkpointing + liger, TRL LoRA 16, TRL plain), for when its deadline cut TRL",
        gpus=1,
        deadline_s=540,
        env=(*ONE_GPU, *EXPANDABLE),
        runs=(by_tag["ours_8b_l2"], by_tag["ours_8b_lora16"], *trl_runs),
        ratios=ratios(*TRL_8B_RATIOS),
        memory_ratios=ratios(*TRL_8B_RATIOS),
        look_for="RATIO ours_8b_l2/trl_8b_gc_liger and ours_8b_lora16/trl_8b_lora16_gc; peak GiB of each side",
    )
    return full, peers


def alloc() -> Suite:
    """``h200-alloc``: the allocator through the library API without an allocator variable, then with one."""
    check = ("benchmarks.alloc_check", "--model-size", "1.5b", "--mix", "heavy", "--pairs", "4", "--steps", "40")
    return Suite(
        name="h200-alloc",
        summary="1x H200: PairDPOTrainer in a plain script (benchmarks.alloc_check, no train.py) on the heavy-tailed "
        "mix, 4 pairs/step, max_length 8192, 1.5B: reserved vs allocated peak with PYTORCH_CUDA_ALLOC_CONF unset, "
        "then set to expandable_segments:True; then the GPU tests",
        gpus=1,
        deadline_s=480,
        env=ONE_GPU,
        runs=(
            Run(
                "alloc_lib", "module", (*check, "--tag", "alloc_lib"), env=NO_ALLOC_CONF, timeout_s=150, log="alloc.log"
            ),
            Run(
                "alloc_lib_expandable",
                "module",
                (*check, "--tag", "alloc_lib_expandable"),
                env=EXPANDABLE,
                timeout_s=150,
                log="alloc.log",
            ),
            GPU_TESTS,
        ),
        look_for="RATIO reserved/allocated of alloc_lib <= 1.15 (target; its row: alloc_env_at_start all None, "
        "allocator_after_train: whether the library set expandable segments, expandable_segments > 0, "
        "num_alloc_retries); alloc_lib_expandable is the same run with the variable set (the reference ratio); "
        "gpu_tests.log: every GPU test passed",
    )


def gpu_tests() -> Suite:
    """``h200-gpu-tests``: ``pytest -q -m gpu tests/`` alone (<= 3 minutes)."""
    return Suite(
        name="h200-gpu-tests",
        summary="1x H200: every GPU test of the repository (pytest -q -m gpu tests/), under 3 minutes",
        gpus=1,
        deadline_s=200,
        env=ONE_GPU,
        runs=(GPU_TESTS,),
        look_for="gpu_tests.log: 'N passed' with no failure (the 2-GPU tests skip)",
    )


SPEED_SUITES = (speed_qwen(), *speed_8b(), alloc(), gpu_tests())
