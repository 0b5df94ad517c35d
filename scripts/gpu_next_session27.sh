#!/usr/bin/env bash
# Written at the end of session 26 for the next session's first call (~8 min worst case):
# (1) GPU tests of session 26's deferred o_proj taking the attention's shrink (test_fp8_gpu's producer-shrink test,
#     now also deferred) and of the deferred chain;
# (2) MOELORA_LORA_ATTN_SHRINK=1 beside the deferred chain: the attention's reduce kernel writes o_proj's shrink
#     partials, so o_proj's chain is the delta kernel alone (session 26's trace: shrink 8.9 + delta 4.3 µs, ending
#     ~1.8 µs after the o_proj GEMM: on the critical path); one A/B process, shared-A adapters, fp8 128/128 batch 64,
#     traced;
# (3) the fused kernel's grid slice first (MOELORA_FUSED_LORA_SLICE_FIRST=1; +0.40% at 4 adapters in one round of
#     session 26 call 4): two rounds, 4 and 8 adapters.
# Files: tests.log, attn.log, attn/, traces/, first.log, first/.
source "$(dirname "$0")/gpu_prelude.sh"
timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
    tests/test_fp8_gpu.py -k "norm_and_attention_write" tests/test_dense_lora_defer.py > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -10
timeout 180 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --expert-lora-layout shared-a --profile-steps 3 --profile-trace "$OUT/traces" --out "$OUT/attn" \
    --ab "attn:MOELORA_LORA_ATTN_SHRINK=1" > "$OUT/attn.log" 2>&1
echo "attention shrink, deferred (rc $?):"; grep -v "^WARN" "$OUT/attn.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^attn" | cut -c1-190
rm -f "$OUT"/traces/*a0* "$OUT"/traces/*a8*
(cd "$OUT/traces" 2>/dev/null && for f in *a4*; do python3 -m moelora.bench.trace "$f" 2>&1 | head -24; done)
timeout 200 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --expert-lora-layout shared-a --ab-rounds 2 --out "$OUT/first" \
    --ab "first:MOELORA_FUSED_LORA_SLICE_FIRST=1" > "$OUT/first.log" 2>&1
echo "slice first, shared A (rc $?):"; grep -v "^WARN" "$OUT/first.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^first" | cut -c1-190
true
