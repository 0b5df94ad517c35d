"""Time one FP8 MoE layer (Qwen3-30B-A3B routed experts, rank-16 adapters) per call from CUDA-graph replay, with
the routed-expert LoRA computed three ways: none (the base), the fused LoRA kernel on the side stream (the
default), the same kernel on the main stream after each GEMM (overlap off). Several layers in rotation so L2 does
not hold a layer's weights. (Session 17 also timed the kernel's programs inside the expert GEMM's own launch here,
commit b6b9e16: no better than the main stream; removed.)

--shared-a: gate and up share each adapter's A (PEFT's target_parameters; read once through a_src). --variants
"name:ENV=V,ENV=V;...": the side-stream case again with those --ab switches set (moelora/bench/switches.py), e.g.
session 28's MOELORA_MOE_LORA_EARLY=1 / MOELORA_MOE_LORA_GU_SPLIT=1.

Usage: python scripts/bench_fp8_moe_lora_layer.py [--tokens 16,64] [--adapters 4,8] [--layers 3] [--shared-a]
       [--variants SPEC] [--out F.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from moelora.adapters.metadata import LoRABatch
from moelora.bench.common import graph_time_us
from moelora.kernels.moe import route_topk_ref
from moelora.layers.fp8 import Fp8State, to_fp8
from moelora.layers.moe import RoutedExperts

H, I, E, K, R = 2048, 768, 128, 8, 16


def layer(seed: int, shared_a: bool = False) -> RoutedExperts:
    g = torch.Generator(device="cuda").manual_seed(seed)
    ex = RoutedExperts(E, H, I, "silu", torch.bfloat16, "cuda")
    ex.gate_up_proj.copy_(torch.randn(E, 2 * I, H, device="cuda", generator=g) * H**-0.5)
    ex.down_proj.copy_(torch.randn(E, H, I, device="cuda", generator=g) * I**-0.5)
    to_fp8(ex, Fp8State((128, 128), torch.bfloat16, None), quantize=True)
    ex.enable_lora(8, R)
    for s in range(8):
        for w in (ex.gate_up_lora, ex.down_lora):
            a = None
            for i, out in enumerate(w.out_features):
                if a is None or not shared_a:
                    a = torch.randn(E, R, w.in_features, device="cuda", generator=g) * w.in_features**-0.5
                w.set_slot(i, s, a, torch.randn(E, out, R, device="cuda", generator=g) * 0.25, 2.0)
    return ex


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="16,64")
    ap.add_argument("--adapters", default="4,8")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--shared-a", action="store_true")
    ap.add_argument("--variants", default="")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from moelora.bench import switches

    variants = switches.parse_ab(args.variants) if args.variants else []
    layers = [layer(i, args.shared_a) for i in range(args.layers)]
    rows = []
    print("µs per MoE layer call (CUDA-graph replay)", flush=True)
    for T in [int(t) for t in args.tokens.split(",")]:
        g = torch.Generator(device="cuda").manual_seed(T)
        x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        tw, ti = route_topk_ref(torch.randn(T, E, device="cuda", generator=g), K, True)
        tw = tw.bfloat16()
        for n_ad in [int(a) for a in args.adapters.split(",")]:
            batch = LoRABatch.build([t % n_ad for t in range(T)], 8, "cuda")
            res = {"tokens": T, "adapters": n_ad}


            for name, overlap, b in [("base", True, None), ("side_stream", True, batch), ("main_stream", False, batch)]:
                for ex in layers:
                    ex.overlap = overlap
                res[name] = graph_time_us(lambda li, b=b: layers[li](x, tw, ti, b), args.layers)
            for ex in layers:
                ex.overlap = True
            for vname, env in variants:  # the side-stream case with the variant's switches
                before = switches.current(list(env))
                switches.apply(env)
                try:
                    res[vname] = graph_time_us(lambda li: layers[li](x, tw, ti, batch), args.layers)
                finally:
                    switches.apply(before)
            rows.append(res)
            print(f"T {T:4d} adapters {n_ad}: " + "  ".join(f"{k} {v:.1f}" for k, v in res.items()
                                                             if isinstance(v, float)), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shared_a": args.shared_a,
                       "variants": dict(variants), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
