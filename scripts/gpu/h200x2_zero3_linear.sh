#!/usr/bin/env bash
# 2x H200, 1.5B model, leaf decoder layers (the default), zero3_overlap.yaml + ref_zero_stage=0, against 1 GPU eager in
# the same call: 8 pairs and ~16k-token micro-batches, each with DeepSpeed's memory_efficient_linear on (its default:
# every F.linear becomes a Python autograd Function) and off. Device call: kind nvidia-h200-x2, carry [".whl", ".bench"],
# command `bash scripts/gpu/h200x2_zero3_linear.sh`. 3 files come back: env.log, ours_1p5b.log, results.jsonl.
START=$(date +%s); DEADLINE=$((START + 420))
source scripts/gpu/common.sh  # environment, wheels, run(), zero3_variant, log_versions
export OMP_NUM_THREADS=8
log_versions
zero3_variant zero3_plainlinear memory_efficient_linear false
B="scripts/bench_dpo.py --no-cudnn-sdp --progress"; ONE="env CUDA_VISIBLE_DEVICES=0 python3"
Z3T="accelerate launch --config_file accelerate_configs/zero3_overlap.yaml --num_processes 2"
Z3P="accelerate launch --config_file /tmp/zero3_plainlinear.yaml --num_processes 2"
L="--model-size 1.5b --steps 10 --warmup 3"; K="--model-size 1.5b --bs-for-tokens 16384 --steps 8 --warmup 3"
run 50 ours_1p5b.log $ONE $B --tag ours_1gpu_1p5b $L
run 80 ours_1p5b.log $Z3P --main_process_port 29641 $B --tag ours_z3plain_1p5b $L --ref-zero-stage 0
run 80 ours_1p5b.log $Z3T --main_process_port 29642 $B --tag ours_z3tuned_1p5b $L --ref-zero-stage 0
run 50 ours_1p5b.log $ONE $B --tag ours_1gpu_1p5b_16k $K
run 80 ours_1p5b.log $Z3T --main_process_port 29643 $B --tag ours_z3tuned_1p5b_16k $K --ref-zero-stage 0
run 80 ours_1p5b.log $Z3P --main_process_port 29644 $B --tag ours_z3plain_1p5b_16k $K --ref-zero-stage 0
grep -h -E "^(WARNING|SKIPPED|Traceback|\S*Error)" $OUT/*.log | sort | uniq -c
R="--ratio ours_z3tuned_1p5b ours_1gpu_1p5b --ratio ours_z3plain_1p5b ours_1gpu_1p5b"
R="$R --ratio ours_z3tuned_1p5b_16k ours_1gpu_1p5b_16k --ratio ours_z3plain_1p5b_16k ours_1gpu_1p5b_16k"
python3 scripts/bench_report.py $OUT/results.jsonl $R
echo "total $(($(date +%s) - START))s"
