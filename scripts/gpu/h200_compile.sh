#!/usr/bin/env bash
# Run on the GPU machine from the repository root, carrying the wheels in .whl/ and ../shared/bench copied to .bench/
# (see docs/bench_dpo_howto.md); results land in $OUT. Device call: kind nvidia-h200-x2 (one GPU used),
# carry [".whl", ".bench"], timeout_s 600, command `bash scripts/gpu/h200_compile.sh`.
# One H200: GPU tests (compile included), TRL baseline, ours eager vs --compile with both ceilings (the packed
# ceiling = 16 docs x 1024 tokens), ours --compile under the profiler, 1.5B --compile. Runs are capped by their own
# timeout AND by a 545 s deadline for the whole call (a run that would pass it gets the time left, or is skipped), so
# the RATIO lines and the summary table always print. 7 files come back: env_and_tests.log, trl.log, ours_254m.log,
# ours_prof.log, ours_1p5b.log, profile_summary.txt, results.jsonl.
START=$(date +%s); DEADLINE=$((START + 545))
source scripts/gpu/common.sh  # environment, wheels, run()
export CUDA_VISIBLE_DEVICES=0
E=$OUT/env_and_tests.log
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $E
python3 -c "import torch,transformers as t,triton;print('torch',torch.__version__,'transformers',t.__version__,'triton',triton.__version__)" >> $E 2>&1
nproc >> $E; cat $E
run 120 env_and_tests.log python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/
tail -5 $E
B="python3 scripts/bench_dpo.py --no-cudnn-sdp"; S="--ceiling --ceiling-shape 16x1024"; L="--model-size 1.5b --steps 15 --warmup 4"
run 90 trl.log python3 .bench/trl_dpo_baseline.py --tag trl_sdpa --attn sdpa --no_cudnn_sdp
run 80 ours_254m.log $B --tag ours_eager $S
run 150 ours_254m.log $B --tag ours_compile --compile $S
run 90 ours_prof.log $B --tag ours_compile_prof --compile --profile --steps 3 --warmup 4
run 80 ours_254m.log $B --tag ours_compile_precomputed --compile --reference precomputed --steps 20
run 90 ours_1p5b.log $B --tag ours_1p5b_eager $L --ceiling
run 120 ours_1p5b.log $B --tag ours_1p5b_compile $L --compile --ceiling
run 120 ours_1p5b.log $B --tag ours_1p5b_16k_compile $L --compile --ceiling --bs-for-tokens 16384
cp $OUT/results.jsonl /tmp/h200_compile_results.jsonl 2>/dev/null  # for call 2's ratios on a warm machine
grep -h -E "^(RATIO|WARNING|SKIPPED|Traceback|\S*Error)" $OUT/*.log
sed -n '/^Host wall time per step/,$p' $OUT/profile_summary.txt
R="--ratio ours_compile ours_eager --ratio ours_compile trl_sdpa --ratio ours_eager trl_sdpa"
R="$R --ratio ours_compile ours_compile_ceiling16x1024:pair_dpo_ceiling_shape --ratio ours_compile ours_eager_ceiling16x1024:pair_dpo_ceiling_shape"
R="$R --ratio ours_compile_ceiling16x1024:pair_dpo_ceiling_shape ours_eager_ceiling16x1024:pair_dpo_ceiling_shape"
R="$R --ratio ours_compile ours_compile:pair_dpo_ceiling --ratio ours_1p5b_compile ours_1p5b_compile:pair_dpo_ceiling"
R="$R --ratio ours_compile_precomputed ours_compile --ratio ours_1p5b_compile ours_1p5b_eager"
R="$R --ratio ours_1p5b_16k_compile ours_1p5b_16k_compile:pair_dpo_ceiling"
python3 scripts/bench_report.py $OUT/results.jsonl $R  # the table, then the ratios (target: ours_compile >= 110k tok/s)
echo "total $(($(date +%s) - START))s"
