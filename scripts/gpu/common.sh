# Sourced by the scripts/gpu/*.sh device-call scripts: the environment the GPU machine's notes require, the carried
# wheels installed once per machine, run() (caps each run; needs START and DEADLINE), zero3_variant, log_versions, and
# check_model / train_run for the ZeRO-3 train.py checks.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache  # kept on a warm machine: later runs and calls reuse the kernels
# DRY_RUN=1: install nothing and let run() print its commands instead (tests/test_bench_dpo.py checks the scripts' flags)
if [ -n "$DRY_RUN" ]; then :; elif [ -d /tmp/site/deepspeed ]; then echo "warm machine: /tmp/site already installed"; else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1; fi
export PYTHONPATH=/tmp/site:$PWD
# run SECONDS LOG CMD...: appends a header, the output and the rc to $OUT/LOG; the timeout is cut to the deadline
run() {
  if [ -n "$DRY_RUN" ]; then shift 2; echo "DRY_RUN: $*"; return; fi
  local t=$1 log=$OUT/$2; shift 2; local left=$((DEADLINE - $(date +%s)))
  if [ "$left" -lt 15 ]; then echo "SKIPPED (deadline): $*" | tee -a "$log"; return; fi
  [ "$left" -lt "$t" ] && t=$left
  local t0=$(date +%s); echo "=== $* (timeout ${t}s)" >> "$log"
  timeout "$t" "$@" >> "$log" 2>&1; local rc=$?
  echo "=== rc=$rc $(($(date +%s) - t0))s" >> "$log"; echo "rc=$rc $(($(date +%s) - t0))s (t=$(($(date +%s) - START))s): $*"
}
# zero3_variant NAME KEY JSON_VALUE: /tmp/NAME.json = accelerate_configs/deepspeed/zero3_overlap.json with
# zero_optimization.KEY set to JSON_VALUE, and /tmp/NAME.yaml = zero3_overlap.yaml pointing at it.
zero3_variant() {
  python3 -c "import json,sys; c=json.load(open('accelerate_configs/deepspeed/zero3_overlap.json')); \
c['zero_optimization'][sys.argv[2]]=json.loads(sys.argv[3]); json.dump(c, open('/tmp/'+sys.argv[1]+'.json', 'w'))" "$@"
  sed "s#accelerate_configs/deepspeed/zero3_overlap.json#/tmp/$1.json#" accelerate_configs/zero3_overlap.yaml > /tmp/$1.yaml
}
# versions of the stack into $OUT/env.log
log_versions() {
  python3 -c "import torch,transformers as t,deepspeed as d;print(torch.__version__,t.__version__,d.__version__)" \
    > $OUT/env.log 2>&1
}
# check_model DIR: the random ~0.5B Llama of the ZeRO-3 train.py checks, written to DIR as a pinned snapshot; sets REV
# (its revision) and CHECK_ARGS (the train.py flags those checks share; each script adds steps / eval / save).
check_model() {
  REV=$(python3 scripts/make_random_model.py --out $1 --hidden 1024 --layers 24 --intermediate 5632 --heads 16 | tail -1)
  echo "revision: $REV"
  CHECK_ARGS="--model_name_or_path $1 --ref_model_revision $REV --bf16 true --learning_rate 5e-5 --lr_scheduler_type cosine"
  CHECK_ARGS="$CHECK_ARGS --warmup_steps 5 --logging_steps 1 --max_length 128 --max_prompt_length 64 --seed 0"
  CHECK_ARGS="$CHECK_ARGS --report_to none --disable_tqdm true"
}
# train_run SECONDS DIR NAME CMD...: one capped train.py run with --output_dir DIR/NAME and its log in DIR/NAME.log;
# prints its rc and error lines, copies its trainer_state.json to $OUT/state_NAME.json.
train_run() {
  local t=$1 w=$2 name=$3; shift 3; local t0=$(date +%s)
  timeout "$t" "$@" --output_dir $w/$name > $w/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s) - t0 ))s"
  grep -h -E "Traceback|Error|reference_changed" $w/$name.log | head -5; cp $w/$name/trainer_state.json $OUT/state_$name.json 2>/dev/null
}
