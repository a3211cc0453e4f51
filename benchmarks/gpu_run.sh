#!/usr/bin/env bash
# One batch on the GPU machine (device tool): demo, benchmarks, the test suite.
# usage: bash benchmarks/gpu_run.sh [demo] [bench] [tests] [soak] [sanitizer]
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
for step in "$@"; do
  case $step in
    demo) timeout 240 python3 -m gpuflow demo 2>&1 | tee "$OUT/demo.log" ;;
    bench) timeout 400 python3 -m gpuflow bench ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" ;;
    tests) timeout 500 python3 -m pytest -q -x -p no:cacheprovider ${TEST_ARGS:-} 2>&1 | tee "$OUT/tests.log" | tail -40 ;;
    soak) GPUFLOW_SOAK_EXAMPLES=${SOAK:-5000} timeout 500 compute-sanitizer --tool memcheck --print-limit 20 \
            python3 -m pytest -q -p no:cacheprovider tests/test_cancellation.py -k "cuda" 2>&1 | tee "$OUT/soak.log" | tail -30 ;;
    smoke) timeout 200 python3 benchmarks/cuda_backend_smoke.py 2>&1 | tee "$OUT/smoke.log" | tail -15 ;;
  esac
done
