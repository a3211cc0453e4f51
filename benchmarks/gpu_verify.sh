#!/usr/bin/env bash
# One GPU batch (nvidia-h200-x2): the whole suite on cuda, the await probe
# and the lease-exit bench.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P="python3 -m pytest -q -p no:cacheprovider"
nvidia-smi -L
if [ "${TESTS:-1}" = 1 ]; then
    timeout 240 $P --timeout=120 -k cuda -rfE > "$OUT/tests.log" 2>&1; tail -n 12 "$OUT/tests.log"
fi
if [ "${PROBE:-1}" = 1 ]; then
    timeout 90 python3 benchmarks/probe_await.py cuda > "$OUT/probe_await.log" 2>&1; head -n 3 "$OUT/probe_await.log"
    timeout 60 python3 -m gpuflow bench --only lease > "$OUT/bench_lease.log" 2>&1; tail -n 3 "$OUT/bench_lease.log"
fi
# the memcheck soak: benchmarks/gpu_memcheck.sh (one long hypothesis run per
# process is too slow under memcheck; it runs many short ones in parallel)
