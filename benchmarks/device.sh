#!/usr/bin/env bash
# The GPU machine's environment, then the benchmark runner: `bash benchmarks/device.sh --suite NAME [runner flags]`
# from the repository root (device call: carry [".whl"]; results in $OUT). NVLink multicast stays off (the machine's
# notes); the carried wheels (trl, datasets, deepspeed, ... in .whl/) are installed into /tmp/site, each once per
# machine (a marker per wheel file in /tmp/site/.installed). The optional ones, torchao (fp8) and liger_kernel (TRL's
# --liger), are installed one by one: when one fails to install or import, a WARNING says so and the suite still
# runs (the runs that need it fail with their own message).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1
export TOKENIZERS_PARALLELISM=false TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache  # kernels reused on a warm machine
SITE=${BENCH_SITE:-/tmp/site}  # BENCH_SITE: another folder (tests of this script)
OPTIONAL="torchao liger_kernel"  # distribution names (wheel file prefixes) whose failure does not stop the suite

pip_target() {  # the carried wheels "$@" into $SITE, no index, no dependencies (they are all carried)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$@"
}

install_wheels() {
  [ -d .whl ] || return 0
  mkdir -p "$SITE/.installed"
  local core=() optional=() seen=" " w name dist
  for w in .whl/*.whl; do
    [ -e "$w" ] || continue
    name=$(basename "$w")
    dist=${name%%-*}
    case "$seen" in *" $dist "*) echo "WARNING: a second $dist wheel in .whl/: $name not installed (carry one)"
      continue;; esac
    seen="$seen$dist "
    [ -e "$SITE/.installed/$name" ] && continue
    case " $OPTIONAL " in *" $dist "*) optional+=("$w");; *) core+=("$w");; esac
  done
  if [ ${#core[@]} -gt 0 ]; then
    pip_target "${core[@]}" || exit 1
    for w in "${core[@]}"; do touch "$SITE/.installed/$(basename "$w")"; done
  fi
  for w in "${optional[@]}"; do
    if pip_target "$w"; then touch "$SITE/.installed/$(basename "$w")"; rm -f "$SITE/.torchao_check"
    else echo "WARNING: $(basename "$w") did not install into $SITE: the runs that need it will fail"; fi
  done
  # torchao's wheel also ships its own top-level `test` package, which would shadow the standard library's
  if grep -qs '^test/__init__.py,' "$SITE"/torchao-*.dist-info/RECORD; then rm -rf "$SITE/test"; fi
  [ ${#core[@]} -gt 0 ] || [ ${#optional[@]} -gt 0 ] || echo "warm machine: the carried wheels are in $SITE already"
}

check_torchao() {  # torchao imports on this torch, else without its CUDA extensions (float8 training needs none)
  [ -d "$SITE/torchao" ] || return 0
  local check="$SITE/.torchao_check" probe="import torchao, torchao.float8; print('torchao', torchao.__version__)"
  if [ ! -s "$check" ]; then
    if PYTHONPATH=$SITE timeout 180 python3 -c "$probe" > "$SITE/.torchao_import.log" 2>&1; then echo ok > "$check"
    elif TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1 PYTHONPATH=$SITE timeout 180 python3 -c "$probe" \
        >> "$SITE/.torchao_import.log" 2>&1; then echo skip_so > "$check"
    else echo broken > "$check"; fi
  fi
  case "$(cat "$check")" in
    skip_so) export TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1
      echo "WARNING: torchao imports only without its .so files (TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1 set)";;
    broken) echo "WARNING: torchao does not import (--fp8 runs will fail): $(tail -n 3 "$SITE/.torchao_import.log")";;
  esac
}

case " $* " in *" --dry-run "*|*" --list "*) ;; *)
  install_wheels
  check_torchao
  [ -n "$OUT" ] && { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; PYTHONPATH=$SITE python3 -c "
import importlib, importlib.metadata as md, torch, transformers as t
print('torch', torch.__version__, 'transformers', t.__version__)
for dist, module in (('torchao', 'torchao.float8'), ('liger_kernel', 'liger_kernel.transformers'), ('trl', 'trl'),
                     ('peft', 'peft'), ('triton', 'triton')):
    try:
        version = md.version(dist)
        importlib.import_module(module)
        print(dist, version, 'imports', module)
    except Exception as exc:
        print(dist, 'NOT IMPORTABLE:', type(exc).__name__, exc)"; } > "$OUT/env.log" 2>&1;;
esac
export PYTHONPATH=$SITE:$PWD
exec python3 -m benchmarks.run "$@"
