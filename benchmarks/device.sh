#!/usr/bin/env bash
# The GPU machine's environment, then the benchmark runner: `bash benchmarks/device.sh --suite NAME [runner flags]`
# from the repository root (device call: carry [".whl"]; results in $OUT). NVLink multicast stays off (the machine's
# notes); the carried wheels (trl, datasets, deepspeed, ... in .whl/) are installed once per machine into /tmp/site.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1
export TOKENIZERS_PARALLELISM=false TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache  # kernels reused on a warm machine
case " $* " in *" --dry-run "*|*" --list "*) ;; *)
  if [ -d /tmp/site/deepspeed ]; then echo "warm machine: /tmp/site already installed"; elif [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  fi
  [ -n "$OUT" ] && { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c \
    "import torch,transformers as t;print('torch',torch.__version__,'transformers',t.__version__)"; } > "$OUT/env.log" 2>&1;;
esac
export PYTHONPATH=/tmp/site:$PWD
exec python3 -m benchmarks.run "$@"
