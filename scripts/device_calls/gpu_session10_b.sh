#!/usr/bin/env bash
# Session 10, call 2 (one H200). The side stream's priority (MOELORA_SIDE_STREAM_PRIORITY; PyTorch graphs keep
# per-node priorities): 1. GPU tests (streams, fused MoE with LoRA and overlap); 2. bench decode fp8 128/128
# b64/256: normal priority with the overlap on (0/4/8 adapters) and off (4/8: --lora-overlap both), then high
# priority (4/8 adapters). Files: tests.log, bench.log, normal/ high/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_streams.py \
    tests/test_kernels_fused_moe.py -k "streams or side_stream or with_lora" > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-250 | tail -8
timeout 200 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64,256 --adapter-counts 0,4,8 \
    --lora-overlap both --out "$OUT/normal" > "$OUT/bench.log" 2>&1
MOELORA_SIDE_STREAM_PRIORITY=high timeout 120 python3 -m moelora bench decode --dtype fp8 --workloads vllm \
    --batches 64,256 --adapter-counts 4,8 --out "$OUT/high" >> "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error" | cut -c1-160
true
