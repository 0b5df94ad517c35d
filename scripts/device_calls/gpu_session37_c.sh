#!/usr/bin/env bash
# Session 37, call C (~6 min on a fresh machine): the deferred qkv GEMM at 12-14 pipeline stages
# (MOELORA_DENSE_DEFER_GEMM=64x1sT/0, LoRA steps only). Call B: fewer GEMM programs shrink what the chain costs
# beside the GEMM (qkv at 40 programs: +1.1 µs over the GEMM alone, at the default 80: +2.3) but slow the GEMM
# more. At 14 stages a qkv program holds 224 KB of shared memory, so no chain CTA (24 / 10 KB) fits on its SM: the
# chain runs on the 52 SMs the GEMM's 80 programs leave free, the GEMM keeps its program count.
# (1) scripts/bench_defer_chain.py --gemm-too, 4 adapters, 64 tokens; (2) one A/B process, two rounds, an A each,
# fp8 128/128 batch 64, 0 / 4 adapters; (3) GPU tests: every launch against the reference at qkv / o_proj (bit-equal
# where the K split is the default's), the decode steps with the switch on (48 / 160, and 14 stages at 48).
# Files: chain.log, chain.json, ab.log, ab/, tests.log.
source "$(dirname "$0")/../gpu_prelude.sh"
E=MOELORA_DENSE_DEFER_GEMM
V="default:;q12:$E=64x1s12/0;q13:$E=64x1s13/0;q14:$E=64x1s14/0;o2s14:$E=0/64x2s14"
timeout -s INT 110 python3 scripts/bench_defer_chain.py --tokens 64 --adapters 4 --variants "$V" --gemm-too \
    --json "$OUT/chain.json" > "$OUT/chain.log" 2>&1
echo "dense chain beside its GEMM, µs a call (rc $?):"; grep -v "^WARN" "$OUT/chain.log" | tail -3
timeout -s INT 200 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4 \
    --ab-rounds 2 --out "$OUT/ab" --ab "q14:$E=64x1s14/0;q13:$E=64x1s13/0" > "$OUT/ab.log" 2>&1
echo "A/B (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^q1" | cut -c1-190
timeout -s INT 200 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_fp8_gpu.py \
    tests/test_dense_lora_defer.py -k "defer_gemm or decode_step" > "$OUT/tests.log" 2>&1
echo "GPU tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -8
true
