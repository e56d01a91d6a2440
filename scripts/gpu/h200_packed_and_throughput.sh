#!/usr/bin/env bash
# Run on the GPU machine from the repository root, carrying the wheels in .whl/ and ../shared/bench copied to .bench/
# (see docs/bench_dpo_howto.md); results land in $OUT.
# One H200: GPU tests of the packed path, then the side-by-side benchmark (docs/bench_dpo_howto.md, call 1).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 CUDA_VISIBLE_DEVICES=0 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/env.txt
python3 -c "import torch,transformers as t;print(torch.__version__,t.__version__)" >> $OUT/env.txt; cat $OUT/env.txt
timeout 110 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_packed.py tests/test_collators.py > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$?"; tail -40 $OUT/gpu_tests.log
B="python3 scripts/bench_dpo.py --no-cudnn-sdp"
timeout 90 python3 .bench/trl_dpo_baseline.py --tag trl_sdpa --attn sdpa --no_cudnn_sdp > $OUT/trl_sdpa.log 2>&1; echo "trl rc=$?"
timeout 80 $B --tag ours --ceiling > $OUT/ours.log 2>&1; echo "ours rc=$?"
timeout 60 $B --tag ours_prof --profile --steps 3 --warmup 3 > $OUT/ours_prof.log 2>&1; echo "prof rc=$?"
timeout 60 $B --tag ours_precomputed --reference precomputed --steps 15 > $OUT/ours_pre.log 2>&1; echo "pre rc=$?"
timeout 90 $B --tag ours_1p5b --model-size 1.5b --ceiling --steps 20 --warmup 3 > $OUT/ours_1p5b.log 2>&1; echo "1p5b rc=$?"
timeout 90 $B --tag ours_1p5b_16k --model-size 1.5b --bs-for-tokens 16384 --ceiling --steps 15 --warmup 3 > $OUT/ours_1p5b_16k.log 2>&1; echo "16k rc=$?"
grep -h -E "^(RATIO|Traceback|\S*Error)" $OUT/*.log; head -30 $OUT/profile_summary.txt; $B --summarize $OUT/results.jsonl
