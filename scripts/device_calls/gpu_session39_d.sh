#!/usr/bin/env bash
# Session 39, call D (~6 min): the GPU tests touched by this session's changes, as pytest shards side by side:
# the engine files (DecoderLayer.forward now asks LayerPrefetch.start, a no-op with the switch off, in every decode
# step and graph capture), test_fp8_gpu.py in two chunks (the expert decode tiles), test_l2_prefetch.py and
# test_bench_bandwidth.py. Files: tests-<shard>.log (4).
source "$(dirname "$0")/../gpu_prelude.sh"
IDS=$(mktemp -d)
ENG="tests/test_combine_to_norm.py tests/test_cuda_graphs.py tests/test_deepseek_gpu.py tests/test_dense_lora_defer.py
     tests/test_dense_lora_overlap.py tests/test_docs_field_bugs.py tests/test_graphs_overlap.py
     tests/test_long_prefill_gpu.py tests/test_lora_graph_variants.py tests/test_no_sync_gpu.py tests/test_parity.py
     tests/test_streams.py"
MEM="tests/test_graphs_overlap.py::test_memory_plan_within_budget"
collect() { python3 -m pytest -q -p no:cacheprovider --collect-only "$@" 2>/dev/null | grep "::" | grep -v "$MEM"; }
collect tests/test_fp8_gpu.py > "$IDS/ids-fp8.txt"
n=$(wc -l < "$IDS/ids-fp8.txt"); c=$(( (n + 1) / 2 ))
split -l "$c" -d "$IDS/ids-fp8.txt" "$IDS/ids-fp8-"
# shellcheck disable=SC2086
collect $ENG > "$IDS/ids-eng.txt"
collect tests/test_l2_prefetch.py tests/test_bench_bandwidth.py > "$IDS/ids-new.txt"
wc -l "$IDS"/ids-*.txt | sed 's|.*/||' | tr '\n' ' '; echo
pids=()
for f in "$IDS"/ids-fp8-0* "$IDS/ids-eng.txt" "$IDS/ids-new.txt"; do
  name=$(basename "$f" .txt); name=${name#ids-}
  # shellcheck disable=SC2046
  timeout -s INT 420 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short $(cat "$f") > "$OUT/tests-$name.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
for f in "$OUT"/tests-*.log; do
  echo "== $(basename "$f"): $(grep -E "passed|failed" "$f" | tail -1)"; grep -E "^FAILED|^ERROR" "$f" | cut -c1-200
done
true
