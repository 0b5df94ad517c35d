#!/usr/bin/env bash
# One device call for the GPU tests: the given pytest files / node ids / options, or with none every test marked
# `gpu` (ALL=1: the whole suite, the CPU tests then running the compiled kernels too). The tests are split into
# SHARDS pytest processes run side by side on the one machine (its cores compile the Triton kernels in parallel; no
# test times anything), each stopped with SIGINT at TIMEOUT seconds; the memory-plan test reads the GPU's free
# memory, so it runs alone after them. tests/test_parallel_gpu.py needs 2 GPUs and skips on one: run it alone on a
# 2-GPU machine (`bash scripts/gpu_tests.sh tests/test_parallel_gpu.py`).
# Usage: MOELORA_COMMIT=<sha> bash scripts/gpu_tests.sh [pytest args...]
# env: SHARDS (4; with more than 1 only the -m / -k options reach the shards, which get node ids; SHARDS=1 runs one
# pytest with the arguments as given), TIMEOUT (470 s a shard), ALL (0).
# Files into $OUT: tests-<n>.log per shard, memory.log; the summary and the failures are printed.
source "$(dirname "$0")/gpu_prelude.sh"
MEM="tests/test_graphs_overlap.py::test_memory_plan_within_budget"
SHARDS=${SHARDS:-4}
ARGS=("$@")
if [ ${#ARGS[@]} -eq 0 ]; then
    ARGS=(tests)
    [ "${ALL:-0}" = 1 ] || ARGS+=(-m gpu)
fi
if [ "$SHARDS" = 1 ]; then  # one process: every pytest option as given
    timeout -s INT "${TIMEOUT:-470}" python3 -m pytest -q -p no:cacheprovider -rfE --tb=short "${ARGS[@]}" \
        > "$OUT/tests-00.log" 2>&1
    echo "== tests-00.log: $(grep -E " in [0-9.]+s" "$OUT/tests-00.log" | tail -1 | cut -c1-160)"
    grep -E "^FAILED|^ERROR" "$OUT/tests-00.log" | cut -c1-220 | head -20
    exit 0
fi
IDS=$(mktemp -d)
python3 -m pytest -q -p no:cacheprovider --collect-only "${ARGS[@]}" 2>/dev/null | grep "::" | grep -vF "$MEM" \
    > "$IDS/all.txt" || true
n=$(wc -l < "$IDS/all.txt")
echo "$n tests collected for: ${ARGS[*]}"
[ "$n" -gt 0 ] || { python3 -m pytest -q -p no:cacheprovider --collect-only "${ARGS[@]}" 2>&1 | tail -5; exit 1; }
# keep the selection options (-m, -k) for each shard; the node ids replace the paths
OPTS=()
for ((i = 0; i < ${#ARGS[@]}; i++)); do
    case "${ARGS[$i]}" in -m|-k) OPTS+=("${ARGS[$i]}" "${ARGS[$((i + 1))]}"); i=$((i + 1));; esac
done
split -n "l/$SHARDS" -d "$IDS/all.txt" "$IDS/shard-"
pids=()
for f in "$IDS"/shard-*; do
    [ -s "$f" ] || continue
    name=${f##*/shard-}
    timeout -s INT "${TIMEOUT:-470}" xargs -d '\n' -a "$f" python3 -m pytest -q -p no:cacheprovider -rfE \
        --tb=short "${OPTS[@]}" > "$OUT/tests-$name.log" 2>&1 &  # one node id a line, spaces in ids kept
    pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
if grep -qF "$MEM" <(python3 -m pytest -q -p no:cacheprovider --collect-only "${ARGS[@]}" 2>/dev/null); then
    timeout -s INT 60 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short "$MEM" > "$OUT/memory.log" 2>&1
fi
for f in "$OUT"/tests-*.log "$OUT"/memory.log; do
    [ -f "$f" ] || continue
    echo "== ${f##*/}: $(grep -E " in [0-9.]+s" "$f" | tail -1 | cut -c1-160)"
    grep -E "^FAILED|^ERROR" "$f" | cut -c1-220 | head -8
done
true
