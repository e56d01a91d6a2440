#!/usr/bin/env bash
# 2x H200, NCCL: a stalled rank (SIGSTOP) ends the other within ddp_timeout=30 s (watchdog, and blocking wait with our
# collective_timeout message); SIGTERM to one rank stops both after the same step with a checkpoint (exit 75).
# Device call: kind nvidia-h200-x2, carry [".whl"], command `bash scripts/gpu/h200x2_nccl_faults.sh`.
# Files that come back: env.log, nccl_faults.jsonl (one line per case: "ok": true expected), nccl_faults/*/rank*.log.
START=$(date +%s); DEADLINE=$((START + 540))
source scripts/gpu/common.sh  # environment, wheels, run(), log_versions
log_versions
run 520 nccl_faults.log python3 scripts/gpu/nccl_faults.py
grep -h '^{' $OUT/nccl_faults.log > $OUT/nccl_faults.jsonl; cat $OUT/nccl_faults.jsonl
echo "total $(($(date +%s) - START))s"
