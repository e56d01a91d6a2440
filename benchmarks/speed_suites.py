"""1x H200 suites of the larger shapes and the memory options, each one device call of at most 9 minutes: the
Qwen2-1.5B shape (ours vs TRL + liger, ceiling, profile, fp8), the 8B model on one GPU (checkpointing chosen by
``auto``, fp8, LoRA, each fixed checkpointing setting, each prompt packed once or twice, vs TRL), the longest 8B pair
of each side, the allocator as a library user gets it, and the GPU tests.

Order is priority: the runner's deadline skips runs from the end, so ours' main rows come first and TRL's after
ours (TRL is the peer). A run that fails (an OOM of ``--activation-checkpointing off`` on 8B, a flag this version
of the package refuses) prints its ``rc`` and the suite goes on. Measured wall times on the H200: a compiled 8B run
of ours ~140-150 s (two 8B models built, the auto probe, compile, 8 steps), a TRL 8B run ~45 s, a compiled Qwen-shape
run of ours ~60 s, a TRL one ~35 s.
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
    ("-v", "--tb=short", "-p", "no:cacheprovider", "-m", "gpu", "tests/"),
    timeout_s=180,
    log="gpu_tests.log",
)
"""Every GPU test of the repository (``-m gpu``; the 2-GPU ones skip on one GPU). ``-v`` prints each test's name and
outcome as it ends, so a run cut by its suite's deadline still says which test failed."""


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


BUDGET_8B = ("--max-tokens-per-microbatch", "12288")  # 8 pairs of the TRL mix (~9k tokens) stay one micro-batch


def _ours_8b() -> tuple[Run, ...]:
    """Ours on 8B, compiled, by priority: the auto setting (the cheapest checkpointing that fits the budget, measured
    at the start), fp8 under the same auto choice, then the fixed settings for the record."""

    def run(tag: str, *flags: str, timeout_s: int = 170) -> Run:  # a generous cap: a killed run leaves no row
        return ours(tag, NC, *B8, "--compile", *flags, timeout_s=timeout_s, log="ours_8b.log")

    ac = "--activation-checkpointing"
    return (
        run("ours_8b_auto", ac, "auto", *BUDGET_8B, timeout_s=190),
        run("ours_8b_fp8", ac, "auto", *BUDGET_8B, "--fp8", "tensorwise", timeout_s=200),
        run("ours_8b_off", ac, "off"),  # auto measured it over the 12k budget: the run shows what a full step needs
        run("ours_8b_full", ac, "full"),
        run("ours_8b_l2", ac, "layers:2"),
    )


def _trl_8b() -> tuple[Run, ...]:
    """TRL on 8B: full fine-tune with gradient checkpointing (the denominator of the target), with liger too."""
    gc = "--gradient-checkpointing"
    return (
        trl("trl_8b_gc", *TRL_B8, gc, timeout_s=130, log="trl_8b.log"),
        trl("trl_8b_gc_liger", *TRL_B8, gc, "--liger", timeout_s=130, log="trl_8b.log"),
    )


def speed_8b() -> tuple[Suite, Suite, Suite]:
    """``h200-speed-8b`` (the full fine-tune: bf16 under auto, fp8, TRL), ``h200-speed-8b-checkpointing`` (each fixed
    setting) and ``h200-speed-8b-lora`` (LoRA 16 on both sides): each one device call."""
    ours_runs, trl_runs = _ours_8b(), _trl_8b()
    first, fp8, *fixed = ours_runs
    full = Suite(
        name="h200-speed-8b",
        summary="1x H200: the 8B model on ONE GPU (bf16 weights and AdamW states, bf16 reference: ~75 GiB static), "
        "8 pairs/step, compiled: activation checkpointing 'auto' at a 12k-token budget, fp8 tensorwise under the "
        "same auto choice; then TRL with gradient checkpointing, and with liger",
        gpus=1,
        deadline_s=540,
        env=(*ONE_GPU, *EXPANDABLE),
        runs=(first, fp8, *trl_runs),
        ratios=ratios("ours_8b_auto/trl_8b_gc", "ours_8b_fp8/ours_8b_auto", "ours_8b_auto/trl_8b_gc_liger"),
        memory_ratios=ratios("ours_8b_auto/trl_8b_gc", "ours_8b_fp8/ours_8b_auto"),
        look_for="config_activation_checkpointing and the run summary's 'auto -> MODE (peak ... GiB)' of ours_8b_auto "
        "and ours_8b_fp8 (what auto chose for each); RATIO ours_8b_auto/trl_8b_gc (target >= 3.5) and "
        "ours_8b_fp8/ours_8b_auto (target >= 1.3); peak_alloc_gib / peak_reserved_gib of every row; SKIPPED "
        "(deadline) lines for what was cut",
    )
    checkpointing = Suite(
        name="h200-speed-8b-checkpointing",
        summary="1x H200: the 8B full fine-tune under each fixed activation-checkpointing setting (off, full, every "
        "2nd layer), against auto (off under compile at the 12k budget): tok/s and peak memory of each",
        gpus=1,
        deadline_s=540,
        env=(*ONE_GPU, *EXPANDABLE),
        runs=(first, *fixed),
        ratios=ratios(*(f"{r.tag}/ours_8b_auto" for r in fixed)),
        memory_ratios=ratios(*(f"{r.tag}/ours_8b_auto" for r in fixed)),
        look_for="peak_alloc_gib and real tok/s of each setting; what auto chose (its run summary line); RATIO "
        "ours_8b_off/ours_8b_auto: ~1.0 when auto chose off (across calls auto -> off ran 2.5% slower than plain off)",
    )
    lora = Suite(
        name="h200-speed-8b-lora",
        summary="1x H200: the 8B model with LoRA r16 on the attention and MLP projections, 8 pairs/step: ours compiled "
        "without checkpointing (the frozen base keeps no weight gradients or Adam state) against TRL LoRA r16 with "
        "gradient checkpointing",
        gpus=1,
        deadline_s=540,
        env=(*ONE_GPU, *EXPANDABLE),
        runs=(
            ours("ours_8b_lora16", NC, *B8, "--compile", "--lora", "16", timeout_s=170, log="ours_8b.log"),
            trl(
                "trl_8b_lora16_gc", *TRL_B8, "--lora", "16", "--gradient-checkpointing", timeout_s=140, log="trl_8b.log"
            ),
        ),
        ratios=ratios("ours_8b_lora16/trl_8b_lora16_gc"),
        memory_ratios=ratios("ours_8b_lora16/trl_8b_lora16_gc"),
        look_for="RATIO ours_8b_lora16/trl_8b_lora16_gc (target >= 3); peak GiB of each side; LoRA rows: 8N counts "
        "weight gradients LoRA does not compute, compare tok/s",
    )
    return full, checkpointing, lora


def share_8b() -> Suite:
    """``h200-share-8b``: the 8B full fine-tune with each prompt packed once, against TRL and against the prompt packed
    twice, in one call (the ratios of one machine and clock). TRL runs before the unshared row: the target compares
    ours shared with TRL, so the deadline cuts the unshared row first."""
    off = ("--compile", "--activation-checkpointing", "off")
    trl_gc, _ = _trl_8b()
    compared = ratios("ours_8b_shared/trl_8b_gc", "ours_8b_shared/ours_8b_unshared")  # speed and memory alike
    return Suite(
        name="h200-share-8b",
        summary="1x H200: the 8B full fine-tune, 8 pairs/step, compiled, no checkpointing: ours with each prompt "
        "packed once (the default), TRL with gradient checkpointing, ours with each prompt packed twice",
        gpus=1,
        deadline_s=540,
        env=(*ONE_GPU, *EXPANDABLE),
        runs=(
            ours("ours_8b_shared", NC, *B8, *off, "--share-prompt", timeout_s=200, log="ours_8b.log"),
            trl_gc,
            ours("ours_8b_unshared", NC, *B8, *off, "--no-share-prompt", timeout_s=200, log="ours_8b.log"),
        ),
        ratios=compared,
        memory_ratios=compared,
        look_for="pairs/s of each row = 8 / step_s_median (the target compares pairs/s; the RATIO lines compare "
        "tokens computed, and ours_8b_shared computes each prompt once: its trl_tok_s_gpu is its rate as TRL counts); "
        "prompt_tokens_saved_frac of ours_8b_shared; peak_alloc_gib of each row",
    )


LONGEST_8B = (
    "benchmarks.longest_pair",
    "--model-size",
    "8b",
    "--no-cudnn-sdp",
    "--prompt-frac",
    "0.9",
    "--max-tries",
    "1",
)
"""One try of one length per run: an 8B try is minutes, so the two lengths that decide "ours >= 2x TRL + liger" are
named (docs/benchmarks_howto.md gives the arithmetic) instead of searched."""


def longest_8b() -> tuple[Suite, Suite]:
    """``h200-longest-8b-trl`` (TRL + liger with gradient checkpointing on one 122,880-token pair: out of memory
    expected) and ``h200-longest-8b-ours`` (ours on twice that): one device call each, the TRL one first."""

    def suite(side: str, strategy: str, tokens: int, try_s: int, summary: str) -> Suite:
        tag = f"longest_8b_{side}"
        args = (*LONGEST_8B, "--tag", tag, "--side", side, "--strategy", strategy, "--start", str(tokens))
        return Suite(
            name=f"h200-longest-8b-{side}",
            summary=f"1x H200: the 8B full fine-tune, one pair of {tokens:,} tokens (prompt 90%) with AdamW's moments "
            f"resident: {summary}",
            gpus=1,
            deadline_s=try_s + 25,
            env=(*ONE_GPU, *EXPANDABLE),
            runs=(Run(tag, "module", (*args, "--try-timeout", str(try_s)), timeout_s=try_s + 15, log="longest.log"),),
            look_for="longest.log / results.jsonl: the TRY row's status (ok, oom, timeout), peak_alloc_gib and "
            "train_s; `python -m benchmarks.longest_pair --summarize $OUT/results.jsonl` prints the table",
        )

    trl_summary = "TRL + liger with gradient checkpointing (out of memory expected)"
    ours_summary = "ours with full checkpointing, activations in host memory, the MLP in tiles (twice TRL's try)"
    return suite("trl", "liger+gc", 122880, 200, trl_summary), suite(
        "ours", "full+offload+tiled", 245760, 535, ours_summary
    )


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
    """``h200-gpu-tests``: ``pytest -v -m gpu tests/`` alone (<= 3 minutes)."""
    return Suite(
        name="h200-gpu-tests",
        summary="1x H200: every GPU test of the repository (pytest -v -m gpu tests/), under 3 minutes",
        gpus=1,
        deadline_s=200,
        env=ONE_GPU,
        runs=(GPU_TESTS,),
        look_for="gpu_tests.log: 'N passed' with no failure (the 2-GPU tests skip)",
    )


SPEED_SUITES = (speed_qwen(), *speed_8b(), share_8b(), *longest_8b(), alloc(), gpu_tests())
