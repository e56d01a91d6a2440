#!/usr/bin/env bash
# Run on the GPU machine from the repository root, carrying the wheels in .whl/ and ../shared/bench copied to .bench/
# (see docs/bench_dpo_howto.md); results land in $OUT.
# Two H200 with ZeRO-3: DP=1 vs DP=2 loss curves, 10 steps (docs/zero3_howto.md).
source scripts/gpu/common.sh  # environment, wheels, check_model, train_run
export OMP_NUM_THREADS=8
W=/tmp/z3b; mkdir -p $W
check_model $W/llama-0.5b
COMMON="$CHECK_ARGS --max_steps 10 --eval_steps 10 --save_steps 10 --save_total_limit 1"
Z="accelerate launch --config_file accelerate_configs/zero3.yaml"
run() { train_run 110 $W "$@"; }
run dp1_std $Z --num_processes 1 --main_process_port 29601 train.py $COMMON --per_device_train_batch_size 16 --gradient_accumulation_steps 2
run dp2_std $Z --num_processes 2 --main_process_port 29602 train.py $COMMON --per_device_train_batch_size 8 --gradient_accumulation_steps 2
python3 scripts/plot_loss_curves.py $W/dp1_std/trainer_state.json $W/dp2_std/trainer_state.json --labels "DP=1" "DP=2" --out $OUT/dp1_vs_dp2.png
grep -h -E "^(Traceback|\S*Error)" $W/*.log | head; cat $W/*.log > $OUT/all_logs.txt
