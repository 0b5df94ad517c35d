#!/usr/bin/env bash
# Session 12, call 3 (one H200). 1. GPU tests: the sampler (all-greedy batches now on the torch path), the
# per-pair LoRA kernel at Qwen3 shapes with unroll 0/4/8 (its W_C bound now computed on the host: Triton 3.6 did
# not fold tl.cdiv of constexprs, call 2). 2. The per-pair kernel alone in store mode at unroll 0/2/4/8. 3. bench
# decode fp8 128/128 b64: defaults with 0/4/8 adapters; then the best unroll of step 2
# (gate_up + down at 64 tokens, 4 adapters) with 4/8 adapters. 4. 32 adapters at batch 256 (and none).
# Files: tests.log, lora_fused.log, bench.log, default/ unroll/ a32/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_sample_triton.py \
    tests/test_kernels_lora_fused.py -k "sample or fast_path or moe_fused_qwen3" > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -8
timeout 60 python3 scripts/bench_lora_fused.py --tokens 64,256 --adapters 4,8 --ranks 16 --cases gate_up,down \
    --unroll 0,2,4,8 > "$OUT/lora_fused.log" 2>&1
grep -v "^WARN" "$OUT/lora_fused.log" | cut -c1-150
U=$(python3 - "$OUT/lora_fused.log" <<'PY'
import re, sys
rows = [dict((int(u), float(t)) for u, t in re.findall(r"(\d+): ([\d.]+)", l.split("unroll:")[1]))
        for l in open(sys.argv[1]) if "store, unroll:" in l][:2]  # gate_up and down, 64 tokens, 4 adapters
print(min((u for u in rows[0] if u > 0), key=lambda u: rows[0][u] + rows[1][u]) if len(rows) == 2 else 4)
PY
)
echo "unroll chosen: $U"
timeout 120 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --out "$OUT/default" > "$OUT/bench.log" 2>&1
MOELORA_FUSED_LORA_UNROLL=$U timeout 85 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 \
    --adapter-counts 4,8 --out "$OUT/unroll" >> "$OUT/bench.log" 2>&1
timeout 170 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 256 --adapter-counts 0,32 \
    --out "$OUT/a32" >> "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error" | cut -c1-160
true
