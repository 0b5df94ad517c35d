#!/usr/bin/env bash
# Session 31, call 4 (~5 min): call 2's 12-stage dense GEMM with the GEMM issued before the chain
# (MOELORA_DENSE_DEFER_ORDER=gemm): its programs would then hold 80 SMs alone (192 KB of shared memory each) before
# the chain's kernels arrive, which go to the SMs left. (1) the chain beside its GEMM, µs a call, each variant's GEMM
# alone too; (2) one A/B process, two rounds, --ab-base, an A each, fp8 128/128 batch 64, 0 / 4 adapters.
# Files: chain.log, chain.json, ab.log, ab/.
source "$(dirname "$0")/../gpu_prelude.sh"
S=MOELORA_FP8_DENSE_DECODE_STAGES; O=MOELORA_DENSE_DEFER_ORDER=gemm
timeout -s INT 60 python3 scripts/bench_defer_chain.py --tokens 64 --adapters 4 --gemm-too \
    --variants "default:;gemm:$O;gemm12:$O,$S=12;gemm8:$O,$S=8;gemm12n:$O,$S=12,MOELORA_DENSE_DEFER_PRIORITY=normal" \
    --json "$OUT/chain.json" > "$OUT/chain.log" 2>&1
echo "dense chain, µs a call (rc $?):"; grep -v "^WARN" "$OUT/chain.log" | tail -4
timeout -s INT 200 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4 \
    --ab-rounds 2 --ab-base --out "$OUT/ab" --ab "gemm:$O;gemm12:$O,$S=12" > "$OUT/ab.log" 2>&1
echo "A/B (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^gemm" | cut -c1-190
true
