#!/usr/bin/env bash
# Written at the end of session 26 for the next session's first call (~7 min worst case):
# (1) GPU tests of what session 26 wrote after its device time ran out: the deferred o_proj taking the attention's
#     shrink (test_fp8_gpu's producer-shrink test, now also deferred) and the deferred chain as one fused launch
#     (test_dense_lora_defer.py's decode-step test, fused parametrized in);
# (2) one A/B process, shared-A adapters, fp8 128/128 batch 64, traced, two variants against the default:
#     attn: MOELORA_LORA_ATTN_SHRINK=1 — the attention's reduce kernel writes o_proj's shrink partials, o_proj's
#       deferred chain is the delta kernel alone (session 26's trace: shrink 8.9 + delta 4.3 µs, ending ~1.8 µs
#       after the o_proj GEMM: on the critical path);
#     fusedchain: MOELORA_DENSE_DEFER_FUSED=1 — each deferred chain one lora_fused_decode launch in store mode.
# Then scripts/device_calls/gpu_next_session27_b.sh (slice first, two rounds).
# Files: tests.log, ab.log, ab/, traces/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
    tests/test_fp8_gpu.py::test_norm_and_attention_write_the_dense_lora_shrinks_in_a_decode_step \
    tests/test_dense_lora_defer.py > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -10
timeout 270 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --expert-lora-layout shared-a --profile-steps 3 --profile-trace "$OUT/traces" --out "$OUT/ab" \
    --ab "attn:MOELORA_LORA_ATTN_SHRINK=1;fusedchain:MOELORA_DENSE_DEFER_FUSED=1" > "$OUT/ab.log" 2>&1
echo "attention shrink / fused chain (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^attn|^fused" | cut -c1-190
rm -f "$OUT"/traces/*a0* "$OUT"/traces/*a8*
(cd "$OUT/traces" 2>/dev/null && for f in *a4*; do python3 -m moelora.bench.trace "$f" 2>&1 | head -24; done)
true
