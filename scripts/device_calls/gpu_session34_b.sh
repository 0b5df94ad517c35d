#!/usr/bin/env bash
# Session 34, call 2 (~9.5 min). Set MOELORA_COMMIT from the dev machine.
#  1. GPU tests of this session's GPU changes: the one-launch chain with the grouped shrink and the spin sleep
#     (tests/test_lora_chain.py, the one-launch decode steps of test_dense_lora_defer.py); the FP8 grouped GEMM at
#     a prefill size under the new prefill default ("experts"), and call 1's unrun rest of tests/test_fp8_gpu.py
#     (its 200 s limit stopped it after 109 of 132; ids in scripts/device_calls/fp8_gpu_rest_s34.txt).
#  2. scripts/bench_defer_chain.py: the chain beside its GEMM: default, one launch with the grouped shrink (one),
#     stacked (onest, session 32's), grouped + spin sleep (onesl), and each serially on one stream.
#     And the grouped routed-expert LoRA at prefill (MOELORA_GROUPED_PREFILL, new, off): its kernel and layer tests.
#  3. One A/B process, fp8 128/128 batch 64, 0 / 4 adapters with an A each, two rounds: one launch (grouped shrink).
# Files: tests.log, chain.log, chain.json, ab.log, ab/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 80 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_lora_chain.py \
    tests/test_dense_lora_defer.py -k "chain or one_launch or (decode_step and one)" > "$OUT/tests.log" 2>&1
echo "chain tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -6
timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu \
    $(cat scripts/device_calls/fp8_gpu_rest_s34.txt) tests/test_fp8_gpu.py::test_fp8_grouped_gemm_qwen3_experts \
    >> "$OUT/tests.log" 2>&1
echo "fp8 tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -6
timeout -s INT 70 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_moe_lora_grouped.py \
    -k "prefill" >> "$OUT/tests.log" 2>&1
echo "grouped prefill tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -4
V="default:;one:MOELORA_DENSE_DEFER_ONE_LAUNCH=1;onest:MOELORA_DENSE_DEFER_ONE_LAUNCH=1,MOELORA_LORA_CHAIN_SHRINK=stacked"
V="$V;onesl:MOELORA_DENSE_DEFER_ONE_LAUNCH=1,MOELORA_LORA_CHAIN_SPIN_SLEEP=1;serial:MOELORA_DENSE_DEFER_ORDER=serial"
V="$V;oneserial:MOELORA_DENSE_DEFER_ONE_LAUNCH=1,MOELORA_DENSE_DEFER_ORDER=serial"
timeout -s INT 70 python3 scripts/bench_defer_chain.py --tokens 64 --adapters 4,8 --variants "$V" \
    --json "$OUT/chain.json" > "$OUT/chain.log" 2>&1
echo "dense chain beside its GEMM, µs a call (rc $?):"; grep -v "^WARN" "$OUT/chain.log" | tail -6
timeout -s INT 190 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4 \
    --ab-rounds 2 --ab-base --out "$OUT/ab" --ab "one:MOELORA_DENSE_DEFER_ONE_LAUNCH=1" > "$OUT/ab.log" 2>&1
echo "A/B (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^one" | cut -c1-190
true
