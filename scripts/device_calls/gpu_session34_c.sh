#!/usr/bin/env bash
# Session 34, call 3 (warm after call 2, ~4.5 min). Set MOELORA_COMMIT from the dev machine.
#  1. scripts/bench_defer_chain.py: the dense chain beside its GEMM: default, one launch with the grouped shrink
#     (one), stacked (onest, session 32's), grouped + spin sleep (onesl), and serially on one stream.
#  2. One A/B process, fp8 128/128 batch 64, 0 / 4 adapters with an A each, two rounds: one launch (grouped).
# Files: chain.log, chain.json, ab.log, ab/.
source "$(dirname "$0")/../gpu_prelude.sh"
V="default:;one:MOELORA_DENSE_DEFER_ONE_LAUNCH=1;onest:MOELORA_DENSE_DEFER_ONE_LAUNCH=1,MOELORA_LORA_CHAIN_SHRINK=stacked"
V="$V;onesl:MOELORA_DENSE_DEFER_ONE_LAUNCH=1,MOELORA_LORA_CHAIN_SPIN_SLEEP=1;serial:MOELORA_DENSE_DEFER_ORDER=serial"
V="$V;oneserial:MOELORA_DENSE_DEFER_ONE_LAUNCH=1,MOELORA_DENSE_DEFER_ORDER=serial"
timeout -s INT 70 python3 scripts/bench_defer_chain.py --tokens 64 --adapters 4,8 --variants "$V" \
    --json "$OUT/chain.json" > "$OUT/chain.log" 2>&1
echo "dense chain beside its GEMM, µs a call (rc $?):"; grep -v "^WARN" "$OUT/chain.log" | tail -6
timeout -s INT 185 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4 \
    --ab-rounds 2 --ab-base --out "$OUT/ab" --ab "one:MOELORA_DENSE_DEFER_ONE_LAUNCH=1" > "$OUT/ab.log" 2>&1
echo "A/B (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^one" | cut -c1-190
true
