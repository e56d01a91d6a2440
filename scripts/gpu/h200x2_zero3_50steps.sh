#!/usr/bin/env bash
# Run on the GPU machine from the repository root, carrying the wheels in .whl/ and ../shared/bench copied to .bench/
# (see docs/bench_dpo_howto.md); results land in $OUT.
# Two H200 with ZeRO-3: DP=1 vs DP=2, precomputed reference, resume, 50 steps (each run capped at 120 s: three were cut short, see docs/benchmarks.md).
source scripts/gpu/common.sh  # environment, wheels, check_model, train_run
export OMP_NUM_THREADS=8
W=/tmp/z3; mkdir -p $W
check_model $W/llama-0.5b
COMMON="$CHECK_ARGS --max_steps 50 --eval_steps 50 --save_steps 25 --save_total_limit 4"
Z="accelerate launch --config_file accelerate_configs/zero3.yaml"
run() { train_run 120 $W "$@"; }
run dp1_std $Z --num_processes 1 --main_process_port 29601 train.py $COMMON --per_device_train_batch_size 16 --gradient_accumulation_steps 2
run dp2_std $Z --num_processes 2 --main_process_port 29602 train.py $COMMON --per_device_train_batch_size 8 --gradient_accumulation_steps 2
run dp2_pre $Z --num_processes 2 --main_process_port 29603 train.py $COMMON --per_device_train_batch_size 8 --gradient_accumulation_steps 2 --precompute_ref_log_probs true
run dp2_resume $Z --num_processes 2 --main_process_port 29604 train.py $COMMON --per_device_train_batch_size 8 --gradient_accumulation_steps 2 --resume_from_checkpoint $W/dp2_std/checkpoint-25
python3 scripts/plot_loss_curves.py $W/dp1_std/trainer_state.json $W/dp2_std/trainer_state.json --labels "DP=1" "DP=2" --out $OUT/dp1_vs_dp2.png
python3 scripts/plot_loss_curves.py $W/dp2_std $W/dp2_pre $W/dp2_resume --labels "online reference" "precomputed" "resumed at 25" --out $OUT/zero3_online_precomputed_resume.png
Z2="accelerate launch --num_processes 2 --config_file"
timeout 80 $Z2 accelerate_configs/zero3.yaml scripts/bench_dpo.py --tag ours_z3 --no-cudnn-sdp --ref-source trainer > $W/ours_z3.log 2>&1; echo "ours_z3 rc=$?"
grep -h -E "^(Traceback|\S*Error)" $W/*.log | head; cat $W/*.log > $OUT/all_logs.txt
python3 scripts/bench_dpo.py --summarize $OUT/results.jsonl
