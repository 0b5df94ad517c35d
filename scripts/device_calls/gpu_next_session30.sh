#!/usr/bin/env bash
# Written at the end of session 29 for session 30's first device call (~9 min; a fresh start costs ~2-3 min more):
# (1) GPU tests: the deferred dense chain's orders bit-equal in and out of graphs (new: "main", the chain on the
# main stream and the GEMM on the side stream, also with the shrink PDL-launched after x's producer), the
# routed-expert issue orders with set_moe_lora_early mode "2" (since session 29's align_stream_above guard), the
# side streams' priorities; (2) the dense chain beside its GEMM, µs a call, default vs "main"
# (scripts/bench_defer_chain.py; no producer kernel there, so no PDL); (3) one A/B process, two rounds, adapters with
# an A each (the layout still short of 90%: 89.2-89.4%), fp8 128/128 batch 64, 0 / 4 / 8, with kernel traces:
# "main", "main" + the PDL shrink, the same + the delta kernel PDL-launched after the shrink, the same with the
# GEMM's stream at normal priority. The traces are summarized on the device; only two are kept.
# Files: tests.log, chain.log, chain.json, ab.log, ab/, trace_summary.txt, traces/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 120 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_dense_lora_defer.py \
    tests/test_kernels_lora_fused.py tests/test_streams.py -k "issued_after or main or early_align or priority" \
    > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -10
timeout -s INT 60 python3 scripts/bench_defer_chain.py --tokens 64 --adapters 4 \
    --variants "default:;main:MOELORA_DENSE_DEFER_ORDER=main" --json "$OUT/chain.json" > "$OUT/chain.log" 2>&1
echo "dense chain, µs a call (rc $?):"; grep -v "^WARN" "$OUT/chain.log" | tail -4
M="MOELORA_DENSE_DEFER_ORDER=main"
timeout -s INT 330 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --ab-rounds 2 --out "$OUT/ab" --profile-steps 3 --profile-trace /tmp/traces \
    --ab "main:$M;mainpdl:$M,MOELORA_LORA_SHRINK_PDL=1;mainpdl2:$M,MOELORA_LORA_SHRINK_PDL=1,MOELORA_DENSE_DEFER_PDL=1;mainpdln:$M,MOELORA_LORA_SHRINK_PDL=1,MOELORA_DENSE_DEFER_PRIORITY=normal" \
    > "$OUT/ab.log" 2>&1
echo "A/B, an A each (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^main" | cut -c1-190
for f in /tmp/traces/*a4*0.json.gz; do python3 -m moelora.bench.trace "$f"; done > "$OUT/trace_summary.txt" 2>&1
mkdir -p "$OUT/traces" && cp /tmp/traces/*a4*default0* /tmp/traces/*a4*mainpdl0* "$OUT/traces/" 2>/dev/null
grep -E "layers|_shrink|_lora_delta|_fp8_gemm|_rms_norm|_qk_norm|_paged_attn_reduce" "$OUT/trace_summary.txt" | cut -c1-100 | head -70
true
