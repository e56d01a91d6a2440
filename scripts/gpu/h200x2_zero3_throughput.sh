#!/usr/bin/env bash
# Run on the GPU machine from the repository root, carrying the wheels in .whl/ and ../shared/bench copied to .bench/
# (see docs/bench_dpo_howto.md); results land in $OUT. Device call: kind nvidia-h200-x2, carry [".whl", ".bench"],
# timeout_s 600, command `bash scripts/gpu/h200x2_zero3_throughput.sh`.
# Two H200, every ratio from rows of this one call: the 1.5B model under ZeRO-3 on 2 GPUs (the trainer's default
# leaf decoder layers; accelerate's auto buckets, then zero3_overlap.yaml + ref_zero_stage=0, then the same with
# --zero3-leaf-modules none) against 1 GPU eager, at 8 pairs and at ~16k-token micro-batches; the 254M model under
# ZeRO-3 against 1 GPU (eager and --compile). Runs are capped by their own timeout AND by a 545 s deadline for the
# whole call. 6 files come back: env.log, ours_1p5b.log, ours_254m.log, results.jsonl (one row per rank),
# profile_summary{,.rank1}.txt (tuned ZeRO-3 1.5B). --compile is not run under ZeRO-3: the trainer refuses it.
START=$(date +%s); DEADLINE=$((START + 545))
source scripts/gpu/common.sh  # environment, wheels, run()
export OMP_NUM_THREADS=8
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/env.log; nvidia-smi topo -m >> $OUT/env.log
python3 -c "import torch,transformers as t,deepspeed as d;print(torch.__version__,t.__version__,d.__version__)" >> $OUT/env.log 2>&1; cat $OUT/env.log
B="scripts/bench_dpo.py --no-cudnn-sdp --progress"; ONE="env CUDA_VISIBLE_DEVICES=0 python3"
Z3="accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2"
DDP="accelerate launch --config_file accelerate_configs/multi_gpu_ddp.yaml --num_processes 2"
L="--model-size 1.5b --steps 10 --warmup 3"; K="--model-size 1.5b --bs-for-tokens 16384 --steps 6 --warmup 3"
Z3T="accelerate launch --config_file accelerate_configs/zero3_overlap.yaml --num_processes 2"
run 60 ours_1p5b.log $ONE $B --tag ours_1gpu_1p5b $L
run 110 ours_1p5b.log $Z3 --main_process_port 29611 $B --tag ours_z3_1p5b $L
run 110 ours_1p5b.log $Z3T --main_process_port 29615 $B --tag ours_z3tuned_1p5b $L --ref-zero-stage 0 --profile
run 110 ours_1p5b.log $Z3T --main_process_port 29617 $B --tag ours_z3tuned_noleaf_1p5b $L --ref-zero-stage 0 --zero3-leaf-modules none
run 100 ours_1p5b.log $Z3T --main_process_port 29612 $B --tag ours_z3tuned_1p5b_16k $K --ref-zero-stage 0
run 60 ours_1p5b.log $ONE $B --tag ours_1gpu_1p5b_16k $K
run 50 ours_254m.log $ONE $B --tag ours_1gpu_compile_254m --compile --steps 20 --warmup 5
run 70 ours_254m.log $Z3T --main_process_port 29616 $B --tag ours_z3tuned_254m --steps 8 --warmup 3 --ref-zero-stage 0
run 40 ours_254m.log $ONE $B --tag ours_1gpu_254m --steps 20 --warmup 5
run 70 ours_254m.log $Z3 --main_process_port 29613 $B --tag ours_z3_254m --steps 8 --warmup 3
grep -h -E "^(RATIO|WARNING|SKIPPED|Traceback|\S*Error)" $OUT/*.log | sort | uniq -c
R="--ratio ours_z3_1p5b ours_1gpu_1p5b --ratio ours_z3tuned_1p5b ours_1gpu_1p5b --ratio ours_z3tuned_noleaf_1p5b ours_1gpu_1p5b"
R="$R --ratio ours_z3tuned_1p5b ours_z3tuned_noleaf_1p5b --ratio ours_z3tuned_1p5b_16k ours_1gpu_1p5b_16k"
R="$R --ratio ours_z3tuned_254m ours_1gpu_compile_254m --ratio ours_z3tuned_254m ours_1gpu_254m --ratio ours_z3_254m ours_1gpu_254m"
python3 scripts/bench_report.py $OUT/results.jsonl --also /tmp/h200_compile_results.jsonl $R
echo "total $(($(date +%s) - START))s"
