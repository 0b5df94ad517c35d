#!/usr/bin/env bash
# Session 31, call 2 (~9 min). (1) The dense decode GEMM's pipeline stages (MOELORA_FP8_DENSE_DECODE_STAGES, new):
# its GPU test (bit-equal at 2 / 8 / 12 stages, qkv and o_proj, 16 / 64 / 256 tokens); the deferred chain beside the
# GEMM at 4 adapters, µs a call, each variant's GEMM alone too (scripts/bench_defer_chain.py --gemm-too); one A/B
# process, two rounds, --ab-base, adapters with an A each, fp8 128/128 batch 64, 0 / 4 / 8. (2) combine-to-norm is
# the default since call 1: the GPU tests of the engine paths it touches that call 1 did not run with it on.
# Files: stages.log, chain.log, chain.json, ab.log, ab/, tests.log.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 60 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_fp8_gpu.py -k decode_stages \
    > "$OUT/stages.log" 2>&1
echo "stages test (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/stages.log" | cut -c1-250 | tail -5
S=MOELORA_FP8_DENSE_DECODE_STAGES
timeout -s INT 60 python3 scripts/bench_defer_chain.py --tokens 64 --adapters 4 --gemm-too \
    --variants "default:;st2:$S=2;st6:$S=6;st8:$S=8;st12:$S=12" --json "$OUT/chain.json" > "$OUT/chain.log" 2>&1
echo "dense chain, µs a call (rc $?):"; grep -v "^WARN" "$OUT/chain.log" | tail -4
timeout -s INT 230 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --ab-rounds 2 --ab-base --out "$OUT/ab" --ab "st8:$S=8;st12:$S=12" > "$OUT/ab.log" 2>&1
echo "A/B (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^st" | cut -c1-190
timeout -s INT 170 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_dense_lora_defer.py \
    tests/test_graphs_overlap.py tests/test_no_sync_gpu.py tests/test_lora_graph_variants.py tests/test_deepseek_gpu.py \
    tests/test_dense_lora_overlap.py tests/test_nvfp4.py tests/test_parity.py > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -8
true
