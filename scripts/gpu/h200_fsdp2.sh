#!/usr/bin/env bash
# One H200, FSDP2 at world size 1 (issue 17): the packed path under FSDP2 beside the non-FSDP run, in one call.
# Run on the GPU machine from the repository root, carrying the wheels in .whl/ (docs/bench_dpo_howto.md); results land
# in $OUT. Device call: kind nvidia-h200, carry [".whl"], timeout_s 300, command `bash scripts/gpu/h200_fsdp2.sh`.
# 1. scripts/bench_dpo.py, 254M model, bf16, 15 timed steps: without FSDP (base_254m), under FSDP2 with the sharded
#    reference (fsdp2_254m) and with the replicated one (fsdp2_254m_refrep): RESULT rows, then the ratios
#    (fsdp2 / base: the per-GPU cost of FSDP2's hooks and fp32 master weights at world size 1).
# 2. train.py on the bundled demo model under FSDP2, bf16: 20 steps (eval at 0 and 10/20, checkpoints at 10 and 20),
#    then a resume from checkpoint-10: the largest loss difference of steps 11-20 (expect 0 up to bf16 kernel noise),
#    the first eval loss (expect 0.6931) and the final weights file (expect model.safetensors).
# 3. If time is left: fsdp2_254m_compile (--compile: regional inductor compile under FSDP2; graphs in warmup steps).
# Every run is capped by its own timeout AND by a 250 s deadline for the whole call; files that come back: env.log,
# bench.log, train.log (with the loss comparison), results.jsonl, state_demo*.json, fsdp2_resume.png.
START=$(date +%s); DEADLINE=$((START + 250))
source scripts/gpu/common.sh  # environment, wheels, run(), train_run
export CUDA_VISIBLE_DEVICES=0 OMP_NUM_THREADS=8
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/env.log
python3 -c "import torch,transformers as t,accelerate as a;print(torch.__version__,t.__version__,a.__version__)" >> $OUT/env.log 2>&1
cat $OUT/env.log
B="scripts/bench_dpo.py --no-cudnn-sdp --steps 15 --warmup 3"
F="accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 1"
run 60 bench.log python3 $B --tag base_254m
run 75 bench.log $F --main_process_port 29631 $B --tag fsdp2_254m
run 75 bench.log $F --main_process_port 29632 $B --tag fsdp2_254m_refrep --ref-fsdp-shard false
T="--bf16 true --max_steps 20 --save_steps 10 --eval_steps 10 --logging_steps 1 --report_to none --disable_tqdm true"
W=/tmp/fsdp2_train; rm -rf $W; mkdir -p $W
left() { echo $((DEADLINE - $(date +%s))); }
[ "$(left)" -gt 30 ] && train_run "$(left)" $W demo $F --main_process_port 29633 train.py $T
[ "$(left)" -gt 30 ] && train_run "$(left)" $W demo_resume $F --main_process_port 29634 train.py $T \
  --resume_from_checkpoint $W/demo/checkpoint-10
{ grep -h "pair_dpo:" $W/demo.log | head -1; ls $W/demo; python3 scripts/plot_loss_curves.py $W/demo $W/demo_resume \
  --labels straight resumed --out $OUT/fsdp2_resume.png; python3 -c "import json,sys; h=json.load(open(sys.argv[1]))\
['log_history']; print('first eval_loss', [e['eval_loss'] for e in h if 'eval_loss' in e][:1])" $W/demo/trainer_state.json
} > $OUT/train.log 2>&1; cat $OUT/train.log
run 120 bench.log $F --main_process_port 29635 $B --tag fsdp2_254m_compile --compile  # only with time left
grep -h -E "^(RESULT|CEILING skipped|SKIPPED|Traceback|\S*Error)" $OUT/bench.log | cut -c1-400
python3 scripts/bench_report.py $OUT/results.jsonl --ratio fsdp2_254m base_254m --ratio fsdp2_254m_refrep base_254m \
  --ratio fsdp2_254m_refrep fsdp2_254m --ratio fsdp2_254m_compile fsdp2_254m
echo "total $(($(date +%s) - START))s"
