#!/usr/bin/env bash
# Session 23, call 2: set_lora_consumer_expand with one dependent round trip in the consumers (row_lora_delta loads
# masked by the buffer rank only). (1) its GPU tests; (2) A/B at fp8 128/128 batch 64, 0 / 4 / 8 adapters (rank 16,
# all targets): both projections, qkv only, o_proj only; profiled with traces, one layer's kernels for 4 adapters.
# Files: tests.log, bench.log, ab/, traces/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_lora_deferred_gpu.py \
    > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -12
timeout 330 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --profile-steps 3 --profile-trace "$OUT/traces" --out "$OUT/ab" \
    --ab "consumer:MOELORA_LORA_CONSUMER_EXPAND=1;qkv:MOELORA_LORA_CONSUMER_EXPAND=qkv;o:MOELORA_LORA_CONSUMER_EXPAND=o_proj" \
    > "$OUT/bench.log" 2>&1
echo "bench (rc $?):"; grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|against the default|^ +[+-][0-9]|Error|Traceback|^A/B|^variant|^default|^consumer|^qkv|^o " | grep -v "^ \+[+-][0-9.]* us  ([0-9.]* -> [0-9.]*)  \(_paged\|_route\|nvjet\|_moe_align\|Memcpy\)" | cut -c1-190
rm -f "$OUT"/traces/*a0* "$OUT"/traces/*a8*
for f in "$OUT"/traces/*consumer0.json.gz; do [ -f "$f" ] && python3 -m moelora.bench.trace "$f" 2>&1 | head -22; done
true
