#!/usr/bin/env bash
# Session 30, call 2 (~7 min): the one-launch router (router_triton.router_topk: gate GEMM + softmax + top-k).
# (1) GPU tests: the kernel at the decode shape and in a graph; the CUDA-graph tests with it on (graphs = eager);
# (2) scripts/bench_router.py: µs per call against F.linear + route_topk, its launch configurations;
# (3) one A/B process, two rounds (--ab-base: the variants run the no-adapter case too), fp8 128/128 batch 64, 0 / 4 / 8 adapters (an A each): the router on with its
# default launch, and with the sweep's best at 64 tokens; traces of the 4-adapter steps summarized.
# Files: tests.log, router.log, router.json, ab.log, ab/, trace_summary.txt.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 60 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_router.py > "$OUT/tests.log" 2>&1
echo "router tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -6
MOELORA_FUSED_ROUTER=1 timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -x \
    tests/test_cuda_graphs.py >> "$OUT/tests.log" 2>&1
echo "graph tests with the router on (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -6
timeout -s INT 90 python3 scripts/bench_router.py --json "$OUT/router.json" > "$OUT/router.log" 2>&1
echo "router µs (rc $?):"; grep -v "^WARN" "$OUT/router.log" | tail -50
BEST=$(python3 -c "
import json; r=[x for x in json.load(open('$OUT/router.json'))['rows'] if x['tokens']==64 and x['config'][0].isdigit()]
print(min(r, key=lambda x: x['us'])['config'])" 2>/dev/null || echo 0x0x0x0x0)
echo "best at 64 tokens: $BEST"
V="router:MOELORA_FUSED_ROUTER=1"
[ "$BEST" != "0x0x0x0x0" ] && V="$V;routerbest:MOELORA_FUSED_ROUTER=1,MOELORA_ROUTER_CONFIG=$BEST"
timeout -s INT 300 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --ab-rounds 2 --ab-base --out "$OUT/ab" --profile-steps 3 --profile-trace /tmp/traces --ab "$V" > "$OUT/ab.log" 2>&1
echo "A/B (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^router" | cut -c1-190
for f in /tmp/traces/*a4*0.json.gz /tmp/traces/*a0*0.json.gz; do
    [ -f "$f" ] && python3 -m moelora.bench.trace "$f"; done > "$OUT/trace_summary.txt" 2>&1
grep -E "layers|nvjet|_route|_router|_moe_align|_rms_norm" "$OUT/trace_summary.txt" | cut -c1-100 | head -40
true
