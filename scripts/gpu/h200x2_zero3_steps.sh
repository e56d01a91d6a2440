#!/usr/bin/env bash
# 2x H200, after h200x2_zero3_throughput.sh timed out its ZeRO-3 runs without a finished step: the same ZeRO-3 runs
# with few steps, generous timeouts and --progress (per-step times on rank 0 even when a run is cut short).
# Device call: kind nvidia-h200-x2, carry [".whl", ".bench"], command `bash scripts/gpu/h200x2_zero3_steps.sh`.
START=$(date +%s); DEADLINE=$((START + 420))
source scripts/gpu/common.sh  # environment, wheels, run()
export OMP_NUM_THREADS=8
B="scripts/bench_dpo.py --no-cudnn-sdp --progress"
Z3="accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2"
Z3T="accelerate launch --config_file accelerate_configs/zero3_overlap.yaml --num_processes 2"
run 170 z3.log $Z3T --main_process_port 29621 $B --tag ours_z3tuned_1p5b --model-size 1.5b --steps 3 --warmup 1 --ref-zero-stage 0
run 150 z3.log $Z3 --main_process_port 29622 $B --tag ours_z3_1p5b --model-size 1.5b --steps 3 --warmup 1
run 90 z3.log $Z3 --main_process_port 29623 $B --tag ours_z3_254m --steps 4 --warmup 2
grep -h -E "^(progress|RESULT|Traceback|\S*Error)" $OUT/z3.log | cut -c1-300
python3 scripts/bench_report.py $OUT/results.jsonl
echo "total $(($(date +%s) - START))s"
