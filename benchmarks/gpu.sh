#!/usr/bin/env bash
# gpuflow on a machine with CUDA devices: the test suite, the benchmarks, the
# probes and the cancellation soaks.  Each step writes its log into one
# folder; a short summary comes last; the exit status is 1 when a step failed.
usage() {
    cat <<'EOF'
usage: benchmarks/gpu.sh [-o DIR] [-w WHEELS] COMMAND...

  -o DIR     where the logs go (default: $OUT when set, else the current directory)
  -w WHEELS  install the wheels in this folder first (no index, no dependencies)
             into a temporary folder put first on PYTHONPATH; default: .whl in
             the repository when it exists

Commands run in the order given; every run starts with info.log (the GPUs,
Python and package versions).  The checkout's src/ is imported, not an
installed gpuflow.

  suite     the whole test suite (sim and cuda)              suite.log
            $TEST_ARGS: more pytest arguments (e.g. '-k cuda -x');
            $TEST_TIMEOUT: per test (300 s); $SUITE_LIMIT: in all (560 s)
  backend   tests/backends/test_cuda_backend.py alone, with the       backend.log
            measurements its tests print
  demo      python -m gpuflow demo                            demo.log
  bench     python -m gpuflow bench $BENCH_ARGS               bench.log, bench.json
  probes    benchmarks/probe_latency.py, probe_await.py cuda, probe_latency.log,
            profile_frontend.py                               probe_await.log,
                                                              profile_frontend.log
  soak      the cancellation soak on cuda, asyncio and Trio  soak_asyncio.log,
            in parallel, $SOAK cases each (2500);            soak_trio.log
            $SOAK_LIMIT: seconds (560)
  memcheck  the soak under compute-sanitizer memcheck:       memcheck.log,
            $JOBS workers (12, asyncio and Trio              memcheck_logs.tgz
            alternately) run chunks of $CHUNK cases (150),
            each chunk its own process, for $LIMIT seconds
            (360); a chunk cut by the time limit counts as
            neither passed nor failed
  all       suite, bench and probes one after the other (timing checks and
            measurements want the GPU to themselves), then soak and memcheck
            together
EOF
}

set -u -o pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${OUT:-.}
wheels=""
while getopts "o:w:h" opt; do
    case $opt in
        o) dir=$OPTARG ;;
        w) wheels=$OPTARG ;;
        h) usage; exit 0 ;;
        *) usage >&2; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
[ $# -gt 0 ] || { usage >&2; exit 2; }
steps=()
for c in "$@"; do
    case $c in
        suite|backend|demo|bench|probes|soak|memcheck) steps+=("$c") ;;
        all) steps+=(suite bench probes soak+memcheck) ;;
        *) echo "unknown command: $c" >&2; usage >&2; exit 2 ;;
    esac
done

mkdir -p "$dir" && dir=$(cd "$dir" && pwd) || exit 2
[ -z "$wheels" ] && [ -d "$root/.whl" ] && wheels=$root/.whl
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -n "$wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$work/site" \
        "$wheels"/*.whl || { echo "installing the wheels of $wheels failed" >&2; exit 2; }
    export PYTHONPATH="$work/site:$root/src${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
fi
# gpuflow uses no NVLink multicast; keep it off for any library that would
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$root" || exit 2

PYTEST=(python3 -m pytest -q -p no:cacheprovider)
SOAK_TEST="tests/core/test_cancellation.py::test_random_pipelines_cancelled_at_random_points"
summary=$work/summary

# note STEP STATUS DETAIL...: one line of the summary (STATUS FAILED: the run fails)
note() {
    printf '%-16s %-7s %s\n' "$1" "$2" "${*:3}" >> "$summary"
    [ "$2" != FAILED ] || : > "$work/failed"
}

# run STEP LOG LIMIT CMD...: CMD under a time limit, its output in LOG
run() {
    local step=$1 log=$dir/$2 limit=$3 rc
    shift 3
    echo "-- $step: $*" >&2
    timeout "$limit" "$@" > "$log" 2>&1
    rc=$?
    local last
    last=$(grep -v '^\s*$' "$log" | tail -n 1 | tr -s ' ' | sed 's/^ //; s/ $//' | cut -c1-100)
    if [ "$rc" = 0 ]; then
        note "$step" ok "$last"
    else
        note "$step" "FAILED" "(exit $rc$([ "$rc" = 124 ] && echo ', time limit'); ${log##*/}) $last"
        grep -E '^(FAILED|ERROR) ' "$log" | head -n 8 | sed 's/^/    /' >> "$summary"
    fi
    return "$rc"
}

info() {
    {
        nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader \
            || echo "nvidia-smi failed"
        python3 - <<'EOF'
import importlib.metadata as md
import sys

print("python", sys.version.split()[0])
for p in ("cuda-bindings", "cuda-core", "numpy", "anyio", "trio", "pytest", "hypothesis"):
    try:
        print(p, md.version(p))
    except md.PackageNotFoundError:
        print(p, "absent")
from gpuflow._backends._cuda import cuda_device_count

print("cuda_device_count()", cuda_device_count())
EOF
    } > "$dir/info.log" 2>&1
    cat "$dir/info.log"
}

suite() {
    local args=()
    eval "args=(${TEST_ARGS:-})"  # shell quoting inside $TEST_ARGS is honoured
    run suite suite.log "${SUITE_LIMIT:-560}" "${PYTEST[@]}" --timeout="${TEST_TIMEOUT:-300}" \
        "${args[@]}"
}

backend() {
    run backend backend.log 300 "${PYTEST[@]}" -rfEP tests/backends/test_cuda_backend.py
}

demo() {
    run demo demo.log 240 python3 -m gpuflow demo
}

bench() {
    local args=()
    eval "args=(${BENCH_ARGS:-})"
    run bench bench.log 400 python3 -m gpuflow bench --json "$dir/bench.json" "${args[@]}"
}

probes() {
    run probe_latency probe_latency.log 300 python3 benchmarks/probe_latency.py
    run probe_await probe_await.log 120 python3 benchmarks/probe_await.py cuda
    run profile_frontend profile_frontend.log 120 python3 benchmarks/profile_frontend.py
}

soak() {
    local limit=${SOAK_LIMIT:-560} lib
    for lib in asyncio trio; do
        GPUFLOW_SOAK_EXAMPLES=${SOAK:-2500} run "soak $lib" "soak_$lib.log" "$limit" \
            "${PYTEST[@]}" --timeout=$((limit - 10)) "$SOAK_TEST[cuda-$lib]" &
    done
    wait
}

memcheck() {
    local jobs=${JOBS:-12} chunk=${CHUNK:-150} limit=${LIMIT:-360} w
    local mdir=$dir/memcheck log=$dir/memcheck.log
    if ! command -v compute-sanitizer > /dev/null; then
        note memcheck FAILED "compute-sanitizer is not on PATH"
        return 1
    fi
    echo "-- memcheck: $jobs workers, chunks of $chunk cases, $limit s" >&2
    mkdir -p "$mdir" && : > "$mdir/chunks.txt"
    local end=$(( $(date +%s) + limit ))
    worker() {
        local lib=$1 w=$2 i=0 left clog
        while :; do
            left=$(( end - $(date +%s) ))
            [ "$left" -gt 30 ] || break
            i=$((i + 1))
            clog=$mdir/w${w}_${i}.log
            GPUFLOW_SOAK_EXAMPLES=$chunk timeout "$left" compute-sanitizer --tool memcheck \
                --print-limit 20 --error-exitcode 99 "${PYTEST[@]}" "$SOAK_TEST[cuda-$lib]" \
                > "$clog" 2>&1
            echo "$lib $? $(basename "$clog")" >> "$mdir/chunks.txt"
        done
    }
    for w in $(seq 1 "$jobs"); do
        if [ $((w % 2)) = 1 ]; then worker asyncio "$w" & else worker trio "$w" & fi
    done
    wait
    local lib ok cut bad errors summaries failed=0
    {
        for lib in asyncio trio; do
            ok=$(grep -c "^$lib 0 " "$mdir/chunks.txt")
            cut=$(grep -c "^$lib 124 " "$mdir/chunks.txt")
            bad=$(grep "^$lib " "$mdir/chunks.txt" | grep -vc "^$lib \(0\|124\) ")
            echo "$lib: $ok chunks of $chunk cases passed ($((ok * chunk)) cases)," \
                "$bad failed, $cut cut by the time limit"
            [ "$bad" = 0 ] || failed=1
        done
        echo "chunks by loop and exit status (99: memcheck errors, 124: cut by the time limit):"
        awk '{print $1, $2}' "$mdir/chunks.txt" | sort | uniq -c
        summaries=$(cat "$mdir"/w*.log 2> /dev/null | grep -c 'ERROR SUMMARY')
        errors=$(cat "$mdir"/w*.log 2> /dev/null | grep 'ERROR SUMMARY' | grep -vc ': 0 errors')
        echo "ERROR SUMMARY lines: $summaries, with errors: $errors"
        [ "$errors" = 0 ] || failed=1
        echo "chunks that failed or saw memcheck errors:"
        (cd "$mdir" && grep -l "failed\|Falsifying\|ERROR SUMMARY: [1-9]" w*.log 2> /dev/null \
            | head -n 5)
    } > "$log"
    (cd "$mdir" && tar czf "$dir/memcheck_logs.tgz" w*.log chunks.txt 2> /dev/null) \
        && rm -rf "$mdir"
    if [ "$failed" = 0 ]; then
        note memcheck ok "$(head -n 2 "$log" | paste -sd ' ')"
    else
        note memcheck FAILED "(memcheck.log) $(head -n 2 "$log" | paste -sd ' ')"
    fi
    return "$failed"
}

info
: > "$summary"
for s in "${steps[@]}"; do
    case $s in
        soak+memcheck) soak & memcheck & wait ;;
        *) "$s" ;;
    esac
done
echo
echo "== summary (logs in $dir)"
cat "$summary"
[ ! -e "$work/failed" ]
