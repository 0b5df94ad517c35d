#!/usr/bin/env bash
# Session 29 call 2 (~8 min): (1) the GPU tests of the routed-expert issue orders, set_moe_lora_early mode "2"
# among them (the alignment on its own stream above the side stream's priority: bit-equal in and out of graphs);
# (2) one MoE layer alone, µs a call, early 1 / 2; (3) one A/B process, two rounds, shared-A adapters, fp8 128/128
# batch 64, 0 / 4 / 8 adapters, with kernel traces: early 1 (session 29 call 1 lost 1.5%: its alignment took 21 µs),
# early 2, and early 1 with the side stream at normal priority. The traces are summarized on the device
# (trace_summary.txt) and only the 4-adapter ones kept. Files: tests.log, moe_layer.*, ab.log, ab/, trace_summary.txt.
source "$(dirname "$0")/../gpu_prelude.sh"
python3 -c "import torch; from moelora.kernels.streams import align_stream, side_stream; d=torch.device('cuda'); \
print('priorities: main', torch.cuda.current_stream(d).priority, 'side', side_stream(d).priority, 'align', \
align_stream(d).priority)"
timeout -s INT 100 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_lora_fused.py \
    -k "order" > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -10
V="early:MOELORA_MOE_LORA_EARLY=1;early2:MOELORA_MOE_LORA_EARLY=2"
timeout -s INT 70 python3 scripts/bench_fp8_moe_lora_layer.py --tokens 64 --adapters 4 --shared-a --variants "$V" \
    --out "$OUT/moe_layer.json" > "$OUT/moe_layer.log" 2>&1
echo "one MoE layer, µs a call (rc $?):"; grep -v "^WARN" "$OUT/moe_layer.log" | tail -3
timeout -s INT 300 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --expert-lora-layout shared-a --ab-rounds 2 --out "$OUT/ab" --profile-steps 3 --profile-trace /tmp/traces \
    --ab "early:MOELORA_MOE_LORA_EARLY=1;early2:MOELORA_MOE_LORA_EARLY=2;earlyn:MOELORA_MOE_LORA_EARLY=1,MOELORA_SIDE_STREAM_PRIORITY=normal" \
    > "$OUT/ab.log" 2>&1
echo "A/B (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^early" | cut -c1-190
for f in /tmp/traces/*a4*0.json.gz /tmp/traces/*a0*0.json.gz; do python3 -m moelora.bench.trace "$f"; done \
    > "$OUT/trace_summary.txt" 2>&1
mkdir -p "$OUT/traces" && cp /tmp/traces/*a4*default0* /tmp/traces/*a4*early20* "$OUT/traces/" 2>/dev/null
grep -E "layers|_moe_align|_moe_lora_fused|_fp8_gemm|silu" "$OUT/trace_summary.txt" | cut -c1-100 | head -60
true
