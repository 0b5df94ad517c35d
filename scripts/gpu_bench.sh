#!/usr/bin/env bash
# One device call for a benchmark: `moelora bench KIND --out $OUT ARGS...` (KIND: decode, report or kernels), its
# JSON and full log under $OUT, the lines that matter printed. Every option is `moelora bench KIND`'s own, so the
# GPU count goes there too: `--tp 2` / `--ep 2` for decode (one process per GPU). Two benchmarks on the two GPUs of
# one host at once (each measures its own GPU; they share the host's CPUs, say so):
#   CUDA_VISIBLE_DEVICES=0 bash scripts/gpu_bench.sh report --parts decode --tag qwen3-decode &
#   sleep 60; CUDA_VISIBLE_DEVICES=1 SKIP_INSTALL=1 OUT=$OUT/b bash scripts/gpu_bench.sh report --parts prefill,peft &
#   wait
# report runs with --no-plot (the device image has no matplotlib): draw the PNGs afterwards where it is installed,
# `moelora bench plot OUT/report-*.json --out bench/results`. Record what is kept with
# `python scripts/results_jsonl.py OUT/*.json --set NAME` (bench/results/<kind>.jsonl).
# Usage: MOELORA_COMMIT=<sha> bash scripts/gpu_bench.sh KIND [moelora bench KIND arguments...]
#   bash scripts/gpu_bench.sh decode --dtype fp8 --batches 64,256 --adapter-counts 0,4,8     # the README's grid
#   bash scripts/gpu_bench.sh decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4 --ab-rounds 2 \
#       --ab "late:moe_lora.early_down=0"       # an A/B of kernel configs in one process (docs/configuration.md)
#   bash scripts/gpu_bench.sh decode --preset deepseek-v2-lite --workloads ctx1024 --batches 1,16,64
#   bash scripts/gpu_bench.sh decode --tp 2 --workloads vllm --batches 64,256 --adapter-counts 0,4   # 2 GPUs
#   bash scripts/gpu_bench.sh report --quick          # or --parts prefill, --models, --dtypes, ... (none: --quick)
#   bash scripts/gpu_bench.sh kernels
#   TREES="old=.old new=." bash scripts/gpu_bench.sh decode --dtype fp8 --batches 64,256 --adapter-counts 0,4,8
#       the same benchmark for two trees one after the other in this call (an older tree copied into an ignored
#       folder and carried): each runs from its folder (PYTHONPATH, nothing installed) into $OUT/NAME/, with the
#       demo's greedy rows; then the demo rows are compared and tokens/s of each case printed side by side (with
#       --profile-steps also one layer's kernels, µs per tree: a before / after table in one call)
# env: TIMEOUT (seconds a benchmark; SIGINT at the limit: report keeps every case it finished), TREES, DEMO_TIMEOUT
# (seconds for each tree's demo, 120; 0: no demo),
# MOELORA_DUMP_STACKS_S (stacks of every process that often, for a stuck multi-GPU run).
KIND=${1:-}
case "$KIND" in
    decode|report|kernels) shift ;;
    *) echo "usage: bash scripts/gpu_bench.sh decode|report|kernels [moelora bench arguments...]" >&2; exit 2 ;;
esac
source "$(dirname "$0")/gpu_prelude.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
ARGS=("$@")
if [ "$KIND" = report ]; then
    [ ${#ARGS[@]} -eq 0 ] && ARGS=(--quick)
    ARGS=(--no-plot "${ARGS[@]}")
fi
if [ -n "${TREES:-}" ]; then
    for tree in $TREES; do
        name=${tree%%=*}; dir=$(cd "${tree#*=}" && pwd); mkdir -p "$OUT/$name"
        (cd "$dir" && PYTHONPATH=$dir timeout -s INT "${TIMEOUT:-270}" python3 -m moelora bench "$KIND" \
            --out "$OUT/$name" "${ARGS[@]}" > "$OUT/$name/bench-$KIND.log" 2>&1
         [ "${DEMO_TIMEOUT:-120}" = 0 ] || PYTHONPATH=$dir timeout "${DEMO_TIMEOUT:-120}" python3 -m moelora demo \
            --seed 0 > "$OUT/$name/demo.txt" 2>&1)
        echo "== $name: $(cd "$dir" && PYTHONPATH=$dir python3 -c 'import moelora; print(moelora.__file__)'):" \
            "$(tail -1 "$OUT/$name/demo.txt" 2>/dev/null); $(grep -c tok/s "$OUT/$name/bench-$KIND.log") lines with tok/s"
    done
    python3 "$(dirname "$0")/results_jsonl.py" --compare "$OUT" $TREES
    exit 0
fi
LOG="$OUT/bench-$KIND.log"
timeout -s INT "${TIMEOUT:-570}" python3 -m moelora bench "$KIND" --out "$OUT" "${ARGS[@]}" > "$LOG" 2>&1
rc=$?
# the log keeps report's progress bar; what is printed drops it
tr '\r' '\n' < "$LOG" | grep -v '^bench report:' | grep -v '^WARN' \
    | grep -E "tok/s|µs|ms|floor|kept|start-up|loaded|bandwidth|results|Error|Traceback|^\|" | cut -c1-250 | tail -150
echo "moelora bench $KIND: exit $rc (log: $LOG)"
exit $rc
