#!/usr/bin/env bash
# Run on the GPU machine from the repository root, carrying the wheels in .whl/ (see docs/bench_dpo_howto.md);
# results land in $OUT. One H200: the objectives' GPU checks (tests/test_gpu_losses.py: the chunked head's per-token
# statistics, cost and values; every objective trains 3 bf16 steps), then the benchmark's default row, whose step
# time now includes the statistics (compare with docs/benchmarks.md's last "ours" row).
START=$(date +%s); DEADLINE=$((START + 540))
source scripts/gpu/common.sh
export CUDA_VISIBLE_DEVICES=0
log_versions
run 300 gpu_losses.log python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_gpu_losses.py
grep -h -E "^\[gpu\]|passed|failed" $OUT/gpu_losses.log
run 150 ours.log python3 scripts/bench_dpo.py --no-cudnn-sdp --tag ours_stats --steps 15
grep -h -E "^(RATIO|Traceback|\S*Error)|tokens/s" $OUT/ours.log | head -20
