#!/usr/bin/env bash
# Session 19, call 1 (issue 7): (1) the GPU tests session 18's last call did not reach (tests/test_fp8_gpu.py: the
# FP8 GEMM LoRA epilogue / PDL, FP8 and NVFP4 MoE-with-LoRA, PEFT parity, demo, fast path), the graph-variants test
# and the overlapped fused-MoE test with bf16 deltas; (2) bench decode fp8 128/128 batch 64, 0 / 4 / 8 adapters,
# MOELORA_LORA_DELTA_DTYPE=fp32 then =activation; (3) the same with MOELORA_LORA_GRAPH_VARIANTS=1 on attention-only
# and experts-only adapters (off: session 18 call 4, 11.87 / 12.10 ms attention-only).
# Files: tests*.log, bench_*.log, delta-{fp32,activation}/, variants-on/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_fp8_gpu.py \
    -k "lora or peft or demo or fast_path or producer" > "$OUT/tests_fp8.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests_fp8.log" | cut -c1-300 | tail -8
MOELORA_LORA_DELTA_DTYPE=activation timeout 60 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu \
    tests/test_lora_graph_variants.py \
    tests/test_kernels_lora_fused.py::test_gpu_fused_moe_pairs_graph_replay_and_overlap > "$OUT/tests_new.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests_new.log" | cut -c1-300 | tail -8
for kind in fp32 activation; do
    MOELORA_LORA_DELTA_DTYPE=$kind timeout 120 python3 -m moelora bench decode --dtype fp8 --workloads vllm \
        --batches 64 --adapter-counts 0,4,8 --out "$OUT/delta-$kind" > "$OUT/bench_delta_$kind.log" 2>&1
    echo "delta $kind:"; grep -v "^WARN" "$OUT/bench_delta_$kind.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
done
MOELORA_LORA_GRAPH_VARIANTS=1 timeout 160 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 \
    --adapter-counts 0,4,8 --lora-targets attention,experts --out "$OUT/variants-on" > "$OUT/bench_variants_on.log" 2>&1
echo "variants on:"; grep -v "^WARN" "$OUT/bench_variants_on.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
true
