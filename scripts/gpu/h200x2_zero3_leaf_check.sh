#!/usr/bin/env bash
# 2x H200, after leaf decoder layers became the ZeRO-3 default (PairDPOConfig.zero3_leaf_modules="auto"):
# 1. the 1.5B throughput rows again (1 GPU eager; zero3_overlap.yaml + ref_zero_stage=0) and the same with every
#    decoder-layer weight kept whole on each rank (stage3_param_persistence_threshold 1.2e7 > the largest 11.5M
#    layer matrix: only the embedding and the head are gathered), to see what gathers still cost;
# 2. DP=1 vs DP=2 loss curves under ZeRO-3 with leaf layers (scripts/gpu/h200x2_zero3_dp1_vs_dp2.sh, train.py).
# Device call: kind nvidia-h200-x2, carry [".whl", ".bench"], command `bash scripts/gpu/h200x2_zero3_leaf_check.sh`.
# 7 files come back: env.log, ours_1p5b.log, results.jsonl, state_dp{1,2}_std.json, dp1_vs_dp2.png, all_logs.txt.
START=$(date +%s); DEADLINE=$((START + 330))
source scripts/gpu/common.sh  # environment, wheels, run(), zero3_variant, log_versions
export OMP_NUM_THREADS=8
log_versions
zero3_variant zero3_persist stage3_param_persistence_threshold 12000000
B="scripts/bench_dpo.py --no-cudnn-sdp --progress"; ONE="env CUDA_VISIBLE_DEVICES=0 python3"
L="--model-size 1.5b --steps 10 --warmup 3 --ref-zero-stage 0"
run 50 ours_1p5b.log $ONE $B --tag ours_1gpu_1p5b --model-size 1.5b --steps 10 --warmup 3
run 90 ours_1p5b.log accelerate launch --config_file accelerate_configs/zero3_overlap.yaml --num_processes 2 --main_process_port 29631 $B --tag ours_z3tuned_1p5b $L
run 90 ours_1p5b.log accelerate launch --config_file /tmp/zero3_persist.yaml --num_processes 2 --main_process_port 29632 $B --tag ours_z3persist_1p5b $L
python3 scripts/bench_report.py $OUT/results.jsonl --ratio ours_z3tuned_1p5b ours_1gpu_1p5b --ratio ours_z3persist_1p5b ours_1gpu_1p5b
grep -h -E "^(WARNING|SKIPPED|Traceback|\S*Error)" $OUT/*.log | sort | uniq -c
bash scripts/gpu/h200x2_zero3_dp1_vs_dp2.sh
python3 - <<'PY'
import json, os
logs = {}
for name in ("dp1_std", "dp2_std"):
    path = os.path.join(os.environ["OUT"], f"state_{name}.json")
    if os.path.exists(path):
        logs[name] = {e["step"]: e["loss"] for e in json.load(open(path))["log_history"] if "loss" in e}
if len(logs) == 2:
    common = sorted(set(logs["dp1_std"]) & set(logs["dp2_std"]))
    diffs = [abs(logs["dp1_std"][s] - logs["dp2_std"][s]) for s in common]
    print(f"DP1 vs DP2 (leaf layers): {len(common)} common steps, max |loss diff| {max(diffs):.2e}")
    print("dp1", [round(logs["dp1_std"][s], 5) for s in common]); print("dp2", [round(logs["dp2_std"][s], 5) for s in common])
PY
echo "total $(($(date +%s) - START))s"
