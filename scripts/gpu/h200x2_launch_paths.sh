#!/usr/bin/env bash
# 2x H200: the DPO defaults and every documented launch path on real GPUs (issue 13 items 3 and 11, issue 14 item 2).
# Device call: kind nvidia-h200-x2, carry [".whl"], command `bash scripts/gpu/h200x2_launch_paths.sh`.
# Look for: defaults.log `bf16=True mixed_precision=bf16` (and `bf16=False` under ACCELERATE_MIXED_PRECISION=fp16);
# every launch rc=0 with `pair_dpo: world_size=N` (1 for single_gpu, 2 for the others) printed once, the ZeRO-3 ones
# naming `ZeRO-3 leaf modules`, and a first loss of 0.6931 in $OUT/state_*.json; transformers is 5.17 there.
START=$(date +%s); DEADLINE=$((START + 540))
source scripts/gpu/common.sh  # environment, wheels, run(), log_versions
export OMP_NUM_THREADS=8
log_versions
run 60 defaults.log python3 -c "from pair_dpo_trainer import PairDPOConfig as C; c=C(output_dir='/tmp/d'); \
print(f'bf16={c.bf16} mixed_precision={c.mixed_precision} lr={c.learning_rate} logging_steps={c.logging_steps}')"
run 60 defaults.log env ACCELERATE_MIXED_PRECISION=fp16 python3 -c "from pair_dpo_trainer import PairDPOConfig as C; \
print(f'bf16={C(output_dir=\"/tmp/d\").bf16} under ACCELERATE_MIXED_PRECISION=fp16')"
DEMO="train.py --max_steps 5 --logging_steps 1 --eval_strategy no --eval_on_start false --eval_size 0 --save_strategy no"
DEMO="$DEMO --disable_tqdm true --report_to none"
Z3J=accelerate_configs/deepspeed/zero3.json
launch() {  # launch NAME CMD...: one train.py run, output dir /tmp/launch/NAME, its summary line and first loss
  local name=$1; shift
  run 150 $name.log "$@" --output_dir /tmp/launch/$name
  grep -h -E "^pair_dpo: world_size|Traceback|Error" $OUT/$name.log | cut -c1-200
  cp /tmp/launch/$name/trainer_state.json $OUT/state_$name.json 2>/dev/null
}
launch single_gpu accelerate launch --config_file accelerate_configs/single_gpu.yaml $DEMO
launch ddp accelerate launch --config_file accelerate_configs/multi_gpu_ddp.yaml --num_processes 2 --main_process_port 29631 $DEMO
launch zero3_accelerate accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 --main_process_port 29632 $DEMO
launch torchrun_deepspeed torchrun --nproc_per_node 2 --master_port 29633 $DEMO --deepspeed $Z3J
launch deepspeed_launcher deepspeed --num_gpus 2 --master_port 29634 $DEMO --deepspeed $Z3J
python3 -c "import glob,json; [print(f, [e['loss'] for e in json.load(open(f))['log_history'] if 'loss' in e][:2]) \
for f in sorted(glob.glob('$OUT/state_*.json'))]"
echo "total $(($(date +%s) - START))s"
