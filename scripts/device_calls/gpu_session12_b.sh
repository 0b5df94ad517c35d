#!/usr/bin/env bash
# Session 12, call 2 (one H200). 1. GPU tests: the sampler kernel (rewritten after call 1: lane-wise maxima,
# lg2.approx, greedy rows without noise), the per-pair LoRA kernel at Qwen3 shapes with unroll 0/4/8, its graph
# replay / overlap test. 2. The sampler alone, fused vs torch. 3. The per-pair kernel alone in store mode at unroll
# 0/2/4/8 (64 and 256 tokens, 4/8 adapters, rank 16). 4. bench decode fp8 128/128 b64: defaults with 0/4/8
# adapters, then MOELORA_FUSED_LORA_UNROLL=4 and 8 with 4/8 (same run).
# Files: tests.log, sampler.json, lora_fused.log, bench.log, default/ u4/ u8/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_sample_triton.py \
    tests/test_kernels_lora_fused.py -k "sample or fast_path or moe_fused_qwen3 or graph_replay" > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -14
timeout 40 python3 scripts/bench_sampler.py --out "$OUT/sampler.json" 2>&1 | tail -4
timeout 90 python3 scripts/bench_lora_fused.py --tokens 64,256 --adapters 4,8 --ranks 16 --cases gate_up,down \
    --unroll 0,2,4,8 > "$OUT/lora_fused.log" 2>&1
grep -v "^WARN" "$OUT/lora_fused.log" | cut -c1-150
timeout 100 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --out "$OUT/default" > "$OUT/bench.log" 2>&1
for u in 4 8; do
MOELORA_FUSED_LORA_UNROLL=$u timeout 90 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 \
    --adapter-counts 4,8 --out "$OUT/u$u" >> "$OUT/bench.log" 2>&1
done
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error" | cut -c1-160
true
