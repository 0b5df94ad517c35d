#!/usr/bin/env bash
# Session 12, call 1 (one H200). 1. GPU tests: all of test_fp8_gpu.py (split_k_buffers, never run on the GPU, and
# the NVFP4 long-generation graphs-vs-eager test, never run), the one-pass sampler, the fused routed-expert LoRA
# kernel (now a loop over work items, MOELORA_FUSED_LORA_PROGRAMS caps its programs). 2. The sampler alone, fused vs
# torch. 3. bench decode fp8 128/128 b64: defaults with 0/4/8 adapters, then the LoRA kernel capped at 132 and 264
# programs with 4/8 (same run). Files: tests.log, sampler.json, bench.log, default/ p132/ p264/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 230 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_fp8_gpu.py \
    tests/test_sample_triton.py tests/test_kernels_lora_fused.py > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -14
timeout 40 python3 scripts/bench_sampler.py --out "$OUT/sampler.json" 2>&1 | tail -4
timeout 100 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --out "$OUT/default" > "$OUT/bench.log" 2>&1
for p in 132 264; do
MOELORA_FUSED_LORA_PROGRAMS=$p timeout 90 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 \
    --adapter-counts 4,8 --out "$OUT/p$p" >> "$OUT/bench.log" 2>&1
done
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error" | cut -c1-160
true
