#!/usr/bin/env bash
# Written in session 34 (its device time went to refused starts) for the next session's first call (~9.5 min and a
# fresh start). Set MOELORA_COMMIT from the dev machine.
#  1. GPU tests of session 34's one-launch chain changes (off by default; never run on a GPU): the grouped shrink
#     form and the spin sleep (tests/test_lora_chain.py), the one-launch decode steps (test_dense_lora_defer.py).
#  2. scripts/bench_defer_chain.py: the dense chain beside its GEMM: default, one launch with the grouped shrink
#     (one), stacked (onest, session 32's), grouped + spin sleep (onesl), and serially on one stream.
#  3. One A/B process, fp8 128/128 batch 64, 0 / 4 adapters with an A each, two rounds: one launch (grouped) — the
#     layout 0.6% short of issue 7's 90% (89.4%).
#  4. bf16 prefill with session 34's defaults (grouped LoRA at prefill), 0 / 4 adapters, and the bf16 decode base at
#     batch 64, 0 / 4 / 8 adapters (last measured in session 8).
# Files: tests.log, chain.log, chain.json, ab.log, ab/, prefill.log, prefill.json, bf16/ + bf16.log.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 80 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_lora_chain.py \
    tests/test_dense_lora_defer.py -k "chain or one_launch or (decode_step and one)" > "$OUT/tests.log" 2>&1
echo "chain tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -6
V="default:;one:MOELORA_DENSE_DEFER_ONE_LAUNCH=1;onest:MOELORA_DENSE_DEFER_ONE_LAUNCH=1,MOELORA_LORA_CHAIN_SHRINK=stacked"
V="$V;onesl:MOELORA_DENSE_DEFER_ONE_LAUNCH=1,MOELORA_LORA_CHAIN_SPIN_SLEEP=1;serial:MOELORA_DENSE_DEFER_ORDER=serial"
V="$V;oneserial:MOELORA_DENSE_DEFER_ONE_LAUNCH=1,MOELORA_DENSE_DEFER_ORDER=serial"
timeout -s INT 70 python3 scripts/bench_defer_chain.py --tokens 64 --adapters 4,8 --variants "$V" \
    --json "$OUT/chain.json" > "$OUT/chain.log" 2>&1
echo "dense chain beside its GEMM, µs a call (rc $?):"; grep -v "^WARN" "$OUT/chain.log" | tail -6
timeout -s INT 185 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4 \
    --ab-rounds 2 --ab-base --out "$OUT/ab" --ab "one:MOELORA_DENSE_DEFER_ONE_LAUNCH=1" > "$OUT/ab.log" 2>&1
echo "A/B (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^one" | cut -c1-190
timeout -s INT 100 python3 scripts/profile_prefill.py --dtype bf16 --adapters 0,4 --lines 10 \
    --json "$OUT/prefill.json" > "$OUT/prefill.log" 2>&1
echo "bf16 prefill (rc $?):"; grep -A4 "^variant " "$OUT/prefill.log"; grep -E "Error|Traceback" "$OUT/prefill.log" | tail -3
timeout -s INT 140 python3 -m moelora bench decode --dtype bfloat16 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --out "$OUT/bf16" > "$OUT/bf16.log" 2>&1
echo "bf16 decode (rc $?):"; grep -v "^WARN" "$OUT/bf16.log" | grep -E "tok/s|Error|Traceback" | cut -c1-190
true
