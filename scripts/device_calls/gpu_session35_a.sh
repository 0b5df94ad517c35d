#!/usr/bin/env bash
# Session 35, call A (~9.5 min): set MOELORA_COMMIT from the dev machine.
#  1. GPU tests: the one-launch chain (session 34's grouped shrink and spin sleep; never run on a GPU) and the
#     grouped routed-expert LoRA at prefill with gate_up's slices in one program (new).
#  2. scripts/sweep_grouped_prefill.py: that kernel at a prefill chunk of 8,192 tokens over its launch variants.
#  3. scripts/bench_defer_chain.py: the dense chain beside its GEMM (default, one launch grouped / stacked / spin
#     sleep, serial).
#  4. One A/B process, fp8 128/128 batch 64, 0 / 4 adapters an A each, two rounds: one launch (grouped shrink).
#  5. FP8 prefill, one process, 0 / 4 adapters: default and gate_up's slices in one program.
# Files: tests.log, sweep.log/json, chain.log/json, ab.log + ab/, prefill.log/json.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 110 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_lora_chain.py \
    tests/test_dense_lora_defer.py tests/test_kernels_moe_lora_grouped.py \
    -k "chain or one_launch or (decode_step and one) or prefill" > "$OUT/tests.log" 2>&1
echo "GPU tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -8
timeout -s INT 100 python3 scripts/sweep_grouped_prefill.py --json "$OUT/sweep.json" > "$OUT/sweep.log" 2>&1
echo "grouped prefill sweep (rc $?):"; grep -v "^WARN" "$OUT/sweep.log" | grep -E "^[a-z]|Error" | cut -c1-200
V="default:;one:MOELORA_DENSE_DEFER_ONE_LAUNCH=1;onest:MOELORA_DENSE_DEFER_ONE_LAUNCH=1,MOELORA_LORA_CHAIN_SHRINK=stacked"
V="$V;onesl:MOELORA_DENSE_DEFER_ONE_LAUNCH=1,MOELORA_LORA_CHAIN_SPIN_SLEEP=1;serial:MOELORA_DENSE_DEFER_ORDER=serial"
V="$V;oneserial:MOELORA_DENSE_DEFER_ONE_LAUNCH=1,MOELORA_DENSE_DEFER_ORDER=serial"
timeout -s INT 70 python3 scripts/bench_defer_chain.py --tokens 64 --adapters 4,8 --variants "$V" \
    --json "$OUT/chain.json" > "$OUT/chain.log" 2>&1
echo "dense chain beside its GEMM, µs a call (rc $?):"; grep -v "^WARN" "$OUT/chain.log" | tail -6
timeout -s INT 185 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4 \
    --ab-rounds 2 --ab-base --out "$OUT/ab" --ab "one:MOELORA_DENSE_DEFER_ONE_LAUNCH=1" > "$OUT/ab.log" 2>&1
echo "A/B (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^one" | cut -c1-190
timeout -s INT 110 python3 scripts/profile_prefill.py --dtype fp8 --adapters 0,4 --lines 8 \
    --variants "fuse:MOELORA_GROUPED_PREFILL_FUSE_SLICES=1" --json "$OUT/prefill.json" > "$OUT/prefill.log" 2>&1
echo "fp8 prefill (rc $?):"; grep -A4 "^variant " "$OUT/prefill.log"; grep -E "Error|Traceback" "$OUT/prefill.log" | tail -3
true
