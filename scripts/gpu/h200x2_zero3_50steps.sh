#!/usr/bin/env bash
# Run on the GPU machine from the repository root, carrying the wheels in .whl/ and ../shared/bench copied to .bench/
# (see docs/bench_dpo_howto.md); results land in $OUT.
# Two H200 with ZeRO-3: DP=1 vs DP=2, precomputed reference, resume, 50 steps (each run capped at 120 s: three were cut short, see docs/benchmarks.md).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=8
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
W=/tmp/z3; mkdir -p $W
REV=$(python3 scripts/make_random_model.py --out $W/llama-0.5b --hidden 1024 --layers 24 --intermediate 5632 --heads 16 | tail -1)
echo "revision: $REV"
COMMON="--model_name_or_path $W/llama-0.5b --ref_model_revision $REV --max_steps 50 --bf16 true --learning_rate 5e-5 --lr_scheduler_type cosine --warmup_steps 5 --logging_steps 1 --eval_steps 50 --save_steps 25 --save_total_limit 4 --max_length 128 --max_prompt_length 64 --seed 0 --report_to none --disable_tqdm true"
Z="accelerate launch --config_file accelerate_configs/zero3.yaml"
run() { local name=$1; shift; local t0=$(date +%s); timeout 120 "$@" --output_dir $W/$name > $W/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s) - t0 ))s"; grep -h -E "Traceback|Error|reference_changed" $W/$name.log | head -5; cp $W/$name/trainer_state.json $OUT/state_$name.json 2>/dev/null; }
run dp1_std $Z --num_processes 1 --main_process_port 29601 train.py $COMMON --per_device_train_batch_size 16 --gradient_accumulation_steps 2
run dp2_std $Z --num_processes 2 --main_process_port 29602 train.py $COMMON --per_device_train_batch_size 8 --gradient_accumulation_steps 2
run dp2_pre $Z --num_processes 2 --main_process_port 29603 train.py $COMMON --per_device_train_batch_size 8 --gradient_accumulation_steps 2 --precompute_ref_logps true
run dp2_resume $Z --num_processes 2 --main_process_port 29604 train.py $COMMON --per_device_train_batch_size 8 --gradient_accumulation_steps 2 --resume_from_checkpoint $W/dp2_std/checkpoint-25
python3 scripts/plot_loss_curves.py $W/dp1_std/trainer_state.json $W/dp2_std/trainer_state.json --labels "DP=1" "DP=2" --out $OUT/dp1_vs_dp2.png
python3 scripts/plot_loss_curves.py $W/dp2_std $W/dp2_pre $W/dp2_resume --labels "online reference" "precomputed" "resumed at 25" --out $OUT/zero3_online_precomputed_resume.png
Z2="accelerate launch --num_processes 2 --config_file"
timeout 80 $Z2 accelerate_configs/zero3.yaml scripts/bench_dpo.py --tag ours_z3 --no-cudnn-sdp --ref-source trainer > $W/ours_z3.log 2>&1; echo "ours_z3 rc=$?"
grep -h -E "^(Traceback|\S*Error)" $W/*.log | head; cat $W/*.log > $OUT/all_logs.txt
python3 scripts/bench_dpo.py --summarize $OUT/results.jsonl
