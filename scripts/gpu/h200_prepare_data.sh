#!/usr/bin/env bash
# Run on the GPU machine from the repository root, carrying the wheels in .whl/ (datasets is not installed there);
# results land in $OUT. Device call: kind nvidia-h200 (only its 16 CPU cores are used), carry [".whl"],
# timeout_s 300, command `bash scripts/gpu/h200_prepare_data.sh`.
# Issue 20's targets for `pair-dpo prepare-data` with the bundled tokenizer: 16 workers >= 10x one worker on the
# same input, and 1M rows in under 2 minutes. Generates 1M rows of the demo's shape (every prompt unique), times
# prepare-data in-process (imports warmed, see scripts/bench_data_scale.py) with 1 and 16 workers on the first 50k
# rows, then with 16 workers on all 1M; capped by a 235 s deadline for the whole call. 4 files come back: env.log,
# make_input.log, prepare.log, results.jsonl. Look for the RATIO lines (16 workers vs 1, target >= 10x; the 1M line
# gives the seconds, target < 120 s) and for `SAME_OUTPUTS True` (the 1- and 16-worker 50k outputs' hashes equal).
START=$(date +%s); DEADLINE=$((START + 235))
source scripts/gpu/common.sh  # environment, wheels, run()
export OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=""
E=$OUT/env.log
{ nproc; python3 -c "import os; print('usable cores', len(os.sched_getaffinity(0)))"; lscpu | head -20; } > $E 2>&1
python3 -c "import transformers as t, datasets as d, pyarrow as p; print(t.__version__, d.__version__, p.__version__)" >> $E 2>&1
B="python3 scripts/bench_data_scale.py --results $OUT/results.jsonl"
run 40 make_input.log $B make-input --rows 1000000 --out /tmp/rows_1m.jsonl
head -n 50000 /tmp/rows_1m.jsonl > /tmp/rows_50k.jsonl
run 80 prepare.log $B prepare --input /tmp/rows_50k.jsonl --num-proc 1 16 --repeats 1 --tmp /tmp
run 120 prepare.log $B prepare --input /tmp/rows_1m.jsonl --num-proc 16 --repeats 1 --tmp /tmp
grep -h -E "^(RATIO|wrote|Traceback|\S*Error)" $OUT/*.log
python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; s=[x for x in r if x['rows']==50000]; \
print('SAME_OUTPUTS', len(s) == 2 and s[0]['outputs'] == s[1]['outputs'], [x['outputs'] for x in s])" $OUT/results.jsonl
echo "total $(($(date +%s) - START))s"
