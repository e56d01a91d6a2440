#!/usr/bin/env bash
# Run on the GPU machine from the repository root, carrying the wheels in .whl/ and ../shared/bench copied to .bench/
# (see docs/bench_dpo_howto.md); results land in $OUT. Device call: kind nvidia-h200-x2, carry [".whl", ".bench"],
# timeout_s 600, command `bash scripts/gpu/h200x2_zero3_throughput.sh`.
# Two H200: the 1.5B model under ZeRO-3 on 2 GPUs and alone on 1 GPU (eager) in the same call, at 8 pairs and at
# ~16k-token micro-batches; then the 254M model under ZeRO-3 and under DDP with --compile. Per-GPU ratios at the end
# (the 254M ones against call 1's rows when the machine is still warm: /tmp/h200_compile_results.jsonl).
# Runs are capped by their own timeout AND by a 545 s deadline for the whole call. 4 files come back: env.log,
# ours_1p5b.log, ours_254m.log, results.jsonl (one row per rank). --compile is not run under ZeRO-3: the trainer
# refuses that combination (DeepSpeed's parameter hooks inside compiled layers).
START=$(date +%s); DEADLINE=$((START + 545))
source scripts/gpu/common.sh  # environment, wheels, run()
export OMP_NUM_THREADS=8
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/env.log; nvidia-smi topo -m >> $OUT/env.log
python3 -c "import torch,transformers as t,deepspeed as d;print(torch.__version__,t.__version__,d.__version__)" >> $OUT/env.log 2>&1; cat $OUT/env.log
B="scripts/bench_dpo.py --no-cudnn-sdp --progress"; ONE="env CUDA_VISIBLE_DEVICES=0 python3"
Z3="accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2"
DDP="accelerate launch --config_file accelerate_configs/multi_gpu_ddp.yaml --num_processes 2"
L="--model-size 1.5b --steps 10 --warmup 3"; K="--model-size 1.5b --max-tokens-microbatch 16384 --steps 6 --warmup 3"
Z3T="accelerate launch --config_file accelerate_configs/zero3_overlap.yaml --num_processes 2"
run 60 ours_1p5b.log $ONE $B --tag ours_1gpu_1p5b $L
run 120 ours_1p5b.log $Z3 --main_process_port 29611 $B --tag ours_z3_1p5b $L
run 120 ours_1p5b.log $Z3T --main_process_port 29615 $B --tag ours_z3tuned_1p5b $L --ref-zero-stage 0
run 80 ours_254m.log $DDP --main_process_port 29614 $B --tag ours_ddp_compile_254m --compile --steps 20 --warmup 5
run 50 ours_254m.log $ONE $B --tag ours_1gpu_compile_254m --compile --steps 20 --warmup 5
run 100 ours_1p5b.log $Z3T --main_process_port 29612 $B --tag ours_z3tuned_1p5b_16k $K --ref-zero-stage 0
run 60 ours_1p5b.log $ONE $B --tag ours_1gpu_1p5b_16k $K
run 80 ours_254m.log $Z3 --main_process_port 29613 $B --tag ours_z3_254m --steps 6 --warmup 3
grep -h -E "^(RATIO|WARNING|SKIPPED|Traceback|\S*Error)" $OUT/*.log | sort | uniq -c
R="--ratio ours_z3_1p5b ours_1gpu_1p5b --ratio ours_z3tuned_1p5b ours_1gpu_1p5b --ratio ours_z3tuned_1p5b_16k ours_1gpu_1p5b_16k"
R="$R --ratio ours_ddp_compile_254m ours_1gpu_compile_254m --ratio ours_z3_254m ours_1gpu_compile_254m --ratio ours_ddp_compile_254m ours_z3_254m"
python3 scripts/bench_report.py $OUT/results.jsonl --also /tmp/h200_compile_results.jsonl $R
echo "total $(($(date +%s) - START))s"
