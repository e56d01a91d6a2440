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
