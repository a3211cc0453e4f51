#!/usr/bin/env bash
# The compute-sanitizer memcheck soak of the cancellation suite, on the GPU.
# JOBS workers (asyncio and Trio alternately) each run chunks of CHUNK
# hypothesis cases, every chunk its own memcheck process, until LIMIT seconds
# have passed; a chunk that would not finish in time is not counted.  Chunks
# keep what finished even when the time runs out.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/memcheck"
JOBS=${JOBS:-12} CHUNK=${CHUNK:-150} LIMIT=${LIMIT:-360}
T="tests/test_cancellation.py::test_random_pipelines_cancelled_at_random_points"
end=$(( $(date +%s) + LIMIT ))
worker() {
    local lib=$1 w=$2 i=0
    while :; do
        local left=$(( end - $(date +%s) ))
        [ "$left" -gt 30 ] || break
        i=$((i + 1))
        local log="$OUT/memcheck/w${w}_${i}.log"
        GPUFLOW_SOAK_EXAMPLES=$CHUNK timeout "$left" compute-sanitizer --tool memcheck \
            --print-limit 20 --error-exitcode 99 python3 -m pytest -q -p no:cacheprovider \
            "$T[cuda-$lib]" > "$log" 2>&1
        echo "$lib $? $log" >> "$OUT/memcheck/chunks.txt"
    done
}
for w in $(seq 1 "$JOBS"); do
    if [ $((w % 2)) = 1 ]; then worker asyncio "$w" & else worker trio "$w" & fi
done
wait
cd "$OUT/memcheck"
for lib in asyncio trio; do
    ok=$(grep -c "^$lib 0 " chunks.txt); bad=$(grep "^$lib " chunks.txt | grep -vc "^$lib 0 ")
    echo "$lib: $ok chunks of $CHUNK cases passed ($((ok * CHUNK)) cases); $bad chunks failed or cut by the time limit"
done
echo "chunks by loop and exit status (124: cut by the time limit):"; awk '{print $1, $2}' chunks.txt | sort | uniq -c
echo "ERROR SUMMARY lines: $(cat w*.log | grep -c 'ERROR SUMMARY'), with errors: $(cat w*.log | grep 'ERROR SUMMARY' | grep -vc ': 0 errors')"
grep -l "failed\|Falsifying\|ERROR SUMMARY: [1-9]" w*.log | head -5
tar czf "$OUT/memcheck_logs.tgz" w*.log chunks.txt && rm -f w*.log
