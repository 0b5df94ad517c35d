#!/usr/bin/env bash
# Session 37, call B (~9 min on a fresh machine): the dense FP8 GEMM's launch beside the deferred LoRA chain
# (MOELORA_DENSE_DEFER_GEMM, LoRA steps only). At 64 tokens o_proj's default launch is 128 programs on 132 SMs and
# qkv's 80, so the chain's CTAs always share SMs with GEMM CTAs; fewer GEMM programs leave whole SMs to the chain.
# (1) scripts/bench_defer_chain.py --gemm-too: each launch beside the chain and alone, µs a call, 4 adapters.
# (2) one A/B process, two rounds, an A each, fp8 128/128 batch 64, 0 / 4 adapters.
# (3) GPU tests: every launch at qkv / o_proj against the reference (bit-equal where the K split is the default's);
#     the decode steps with the switch on at batch 48 / 160, graph replay bit-equal to eager; the other decode steps.
# Files: chain.log, chain.json, ab.log, ab/, tests.log.
source "$(dirname "$0")/../gpu_prelude.sh"
E=MOELORA_DENSE_DEFER_GEMM
V="default:;o2:$E=0/64x2;o1:$E=0/64x1;q128:$E=128x1/0;q128s2:$E=128x2/0;both:$E=128x1/64x2;s2:$E=64x2/64x2"
timeout -s INT 120 python3 scripts/bench_defer_chain.py --tokens 64 --adapters 4 --variants "$V" --gemm-too \
    --json "$OUT/chain.json" > "$OUT/chain.log" 2>&1
echo "dense chain beside its GEMM, µs a call (rc $?):"; grep -v "^WARN" "$OUT/chain.log" | tail -4
timeout -s INT 230 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4 \
    --ab-rounds 2 --out "$OUT/ab" --ab "o2:$E=0/64x2;both:$E=128x1/64x2" > "$OUT/ab.log" 2>&1
echo "A/B (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^o2|^both" | cut -c1-190
timeout -s INT 200 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_fp8_gpu.py -k "defer_gemm or deferred" \
    tests/test_dense_lora_defer.py > "$OUT/tests.log" 2>&1
echo "GPU tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -8
true
