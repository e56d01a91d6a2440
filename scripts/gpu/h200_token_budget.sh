#!/usr/bin/env bash
# Run on the GPU machine from the repository root, carrying the wheels in .whl/ and ../shared/bench copied to .bench/
# (see docs/bench_dpo_howto.md); results land in $OUT. Device call: kind nvidia-h200, carry [".whl", ".bench"],
# timeout_s 600, command `bash scripts/gpu/h200_token_budget.sh`.
# Issue 15 on one H200, every ratio from rows of this call (32 pairs per GPU per optimizer step unless said):
#   1.5B eager, heavy-tailed mix (bench_sampler.py "heavy"): budget 16384 vs fixed gradient_accumulation_steps=4, the
#     budget padded to 16384 (= uniform 16,384-token micro-batches: the peak-memory reference), the budget without
#     expandable_segments (every other run sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, as train.py does);
#   1.5B eager, standard (TRL) mix: budget 16384 vs GA=4; 1.5B --compile with the budget vs its 16k-row ceiling;
#   254M --compile, budget 12288 with and without --pad-to-budget, against TRL's padded run (8 pairs/GPU, cuDNN SDPA
#     off); the same 1.5B heavy budget run without expandable_segments; whether CUDA graphs run on the per-layer
#     compiled regions (probe); last (skipped first when time runs short), ours --compile at TRL's 8 pairs per step.
# Runs are capped by their own timeout AND by a 470 s deadline for the whole call (a run that would pass it gets the
# time left, or is skipped), so the RATIO lines and the table always print. Files that come back: env.log, heavy.log,
# std.log, compile.log, small.log, trl.log, probe.log, probe.jsonl, results.jsonl.
# DRY_RUN=1 bash scripts/gpu/h200_token_budget.sh prints the commands only (tests/test_bench_dpo.py parses them).
START=$(date +%s); DEADLINE=$((START + 470))
source scripts/gpu/common.sh  # environment, wheels, run()
export CUDA_VISIBLE_DEVICES=0
[ -z "$DRY_RUN" ] && { log_versions; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $OUT/env.log; cat $OUT/env.log; }
B="python3 scripts/bench_dpo.py --no-cudnn-sdp"; X="env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
H="--model-size 1.5b --mix heavy --steps 4 --warmup 2"; S="--model-size 1.5b --steps 4 --warmup 2"
K16="--bs 32 --max-tokens-per-microbatch 16384"; GA4="--bs 8 --ga 4"
M="--compile --bs 32 --max-tokens-per-microbatch 12288 --steps 8 --warmup 3"
run 75 heavy.log $X $B --tag heavy_b16k $H $K16
run 75 heavy.log $X $B --tag heavy_ga4 $H $GA4
run 75 heavy.log $X $B --tag heavy_b16k_pad $H $K16 --pad-to-budget
run 60 std.log $X $B --tag std_b16k $S $K16
run 60 std.log $X $B --tag std_ga4 $S $GA4
run 120 compile.log $X $B --tag std_b16k_compile --model-size 1.5b --steps 4 --warmup 3 $K16 --compile --ceiling
run 70 trl.log python3 .bench/trl_dpo_baseline.py --tag trl_sdpa --attn sdpa --no_cudnn_sdp --steps 15 --warmup 3
run 60 small.log $X $B --tag small_b12k_pad $M --pad-to-budget
run 60 small.log $X $B --tag small_b12k $M
run 75 heavy.log env -u PYTORCH_CUDA_ALLOC_CONF $B --tag heavy_b16k_noexp $H $K16
run 45 probe.log python3 scripts/probe_cudagraph_layers.py --budget 4096
run 50 small.log $X $B --tag small_8pairs --compile --steps 15 --warmup 3
[ -n "$DRY_RUN" ] && exit 0
grep -h -E "^(RATIO|PROBE|WARNING|SKIPPED|Traceback|\S*Error)" $OUT/*.log
R="--ratio heavy_b16k heavy_ga4 --ratio std_b16k std_ga4 --ratio heavy_b16k heavy_b16k_noexp"
R="$R --ratio std_b16k_compile std_b16k_compile:pair_dpo_ceiling --ratio std_b16k_compile std_b16k"
R="$R --ratio small_b12k_pad trl_sdpa --ratio small_b12k trl_sdpa --ratio small_8pairs trl_sdpa --ratio small_b12k_pad small_b12k"
python3 scripts/bench_report.py $OUT/results.jsonl $R
python3 - $OUT/results.jsonl <<'EOF'
import json, sys  # peak memory and micro-batches per step, the numbers of the issue's first target
rows = {r.get("tag"): r for r in map(json.loads, open(sys.argv[1])) if r.get("impl", "pair_dpo") == "pair_dpo"}
for tag, r in rows.items():
    print(f"MEM {tag}: peak_alloc {r.get('peak_alloc_gib')} GiB, reserved {r.get('peak_reserved_gib')} GiB, "
          f"micro-batches/step {r.get('microbatches_per_step_mean')} (max {r.get('microbatches_per_step_max')}), "
          f"max row {r.get('microbatch_tokens_max')}, alloc_conf {r.get('alloc_conf')}")
for a, b in (("heavy_b16k", "heavy_b16k_pad"), ("heavy_ga4", "heavy_b16k_pad"), ("heavy_b16k_noexp", "heavy_b16k")):
    if a in rows and b in rows and rows[b].get("peak_alloc_gib"):
        print(f"MEM RATIO {a}/{b}: alloc {rows[a]['peak_alloc_gib'] / rows[b]['peak_alloc_gib']:.3f}, "
              f"reserved {rows[a]['peak_reserved_gib'] / rows[b]['peak_reserved_gib']:.3f}")
EOF
echo "total $(($(date +%s) - START))s"
