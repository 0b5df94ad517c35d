#!/usr/bin/env bash
# Session 37, call D (~5 min on a fresh machine): L2 prefetch of the deferred chain's LoRA factors
# (MOELORA_LORA_L2_PREFETCH). Call C: with no chain CTA able to share the qkv GEMM's SMs (14 stages, 224 KB a
# program) the chain still ended ~2 µs after the GEMM: beside the GEMM the chain is longer than alone (its kernels
# wait on HBM for A / B behind the GEMM's weight stream), not crowded off SMs. "own": the shrink prefetches its
# layer's B for the delta kernel; "next": qkv's delta kernel prefetches o_proj's A and B (read after the attention).
# (1) one A/B process, two rounds, an A each, fp8 128/128 batch 64, 0 / 4 adapters: own, next, both;
# (2) scripts/bench_defer_chain.py, 4 adapters, 64 tokens: the chain beside its GEMM with "own";
# (3) GPU tests: the decode steps (the prefetch bit-equal to the deferral without it, eager and replayed, 48 / 160;
#     session 37's GEMM launches) and the prefetch plumbing tests with the PTX really run.
# Files: ab.log, ab/, chain.log, chain.json, tests.log.
source "$(dirname "$0")/../gpu_prelude.sh"
P=MOELORA_LORA_L2_PREFETCH
timeout -s INT 210 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4 \
    --ab-rounds 2 --out "$OUT/ab" --ab "own:$P=own;next:$P=next;both:$P=both" > "$OUT/ab.log" 2>&1
echo "A/B (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^own|^next|^both" | cut -c1-190
timeout -s INT 60 python3 scripts/bench_defer_chain.py --tokens 64 --adapters 4 --variants "default:;own:$P=own" \
    --json "$OUT/chain.json" > "$OUT/chain.log" 2>&1
echo "dense chain beside its GEMM, µs a call (rc $?):"; grep -v "^WARN" "$OUT/chain.log" | tail -3
timeout -s INT 170 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_dense_lora_defer.py \
    -k "decode_step or l2_prefetch" > "$OUT/tests.log" 2>&1
echo "GPU tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -8
true
