#!/usr/bin/env bash
# The GPU batch: the whole suite, a 5,000-case cancellation soak (asyncio and
# Trio in parallel), a compute-sanitizer memcheck soak, and the fault probe.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P="python3 -m pytest -q -p no:cacheprovider"
SOAK_T="tests/test_cancellation.py::test_random_pipelines_cancelled_at_random_points"
timeout 560 $P --timeout=300 > "$OUT/tests.log" 2>&1 &
GPUFLOW_SOAK_EXAMPLES=${SOAK:-2500} timeout 560 $P --timeout=550 "$SOAK_T[cuda-asyncio]" > "$OUT/soak_asyncio.log" 2>&1 &
GPUFLOW_SOAK_EXAMPLES=${SOAK:-2500} timeout 560 $P --timeout=550 "$SOAK_T[cuda-trio]" > "$OUT/soak_trio.log" 2>&1 &
GPUFLOW_SOAK_EXAMPLES=${SAN:-150} timeout 560 compute-sanitizer --tool memcheck --print-limit 20 --error-exitcode 99 \
    $P --timeout=550 "$SOAK_T[cuda-asyncio]" "$SOAK_T[cuda-trio]" > "$OUT/memcheck.log" 2>&1 &
timeout 300 python3 benchmarks/probe_latency.py > "$OUT/probe.log" 2>&1 &
wait
for f in tests soak_asyncio soak_trio memcheck probe; do echo "== $f"; tail -6 "$OUT/$f.log"; done
