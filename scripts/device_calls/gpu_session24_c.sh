#!/usr/bin/env bash
# Session 24, call 3: with MOELORA_DENSE_LORA_DEFER=fp8 the default (its chain without PDL), the GPU tests that run the
# dense LoRA of an FP8 model (the deferral's own, the FP8 file with the demo and PEFT parity, graphs), then one A/B
# process against the GEMM's LoRA epilogue (fp8 128/128 batch 64, 0 / 4 / 8 adapters). Files: tests.log, bench.log, ab/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 270 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_dense_lora_defer.py \
    tests/test_fp8_gpu.py tests/test_graphs_overlap.py tests/test_lora_graph_variants.py > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -16
timeout 220 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --out "$OUT/ab" --ab "epilogue:MOELORA_DENSE_LORA_DEFER=0" > "$OUT/bench.log" 2>&1
echo "bench (rc $?):"; grep -v "^WARN" "$OUT/bench.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^epilogue" | cut -c1-190
true
