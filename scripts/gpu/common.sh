# Sourced by the scripts/gpu/*.sh device-call scripts (after they set START and DEADLINE): the environment the GPU
# machine's notes require, the carried wheels installed once per machine, and run(), which caps each run.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache  # kept on a warm machine: later runs and calls reuse the kernels
if [ -d /tmp/site/deepspeed ]; then echo "warm machine: /tmp/site already installed"; else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1; fi
export PYTHONPATH=/tmp/site:$PWD
# run SECONDS LOG CMD...: appends a header, the output and the rc to $OUT/LOG; the timeout is cut to the deadline
run() {
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
