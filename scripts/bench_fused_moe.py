"""Time one MoE layer forward (router softmax/top-k + routed experts, no LoRA unless --lora) on the GPU:
the Triton fused path (fused_moe_triton.py) vs the old torch._grouped_mm path (moe._ExpertGemm), both
through fused_moe_pairs, replayed from CUDA graphs. Prints µs per layer, the bytes of the experts the
routing touches (counted from topk_ids) and the achieved GB/s.

Usage: python scripts/bench_fused_moe.py [--tokens 1,16,64,128,256,2048] [--lora] [--sweep] [--profile]
--sweep: also times fused_moe_triton with several tile configs per T (for tuning pick_config; ~1-2 min per T,
so sweep a few T per call). --profile: the GPU ops of one layer forward, new path vs old.
Defaults: Qwen3-30B-A3B (H=2048, I=768, E=128, top-8), bf16; 4 layers' weights in rotation so L2 holds none.
"""

from __future__ import annotations

import argparse

import torch

from moelora.bench.common import graph_time_us
from moelora.kernels import fused_moe_triton as fmt
from moelora.kernels.moe import ExpertLoRAArgs, fused_moe_pairs, route_topk_ref


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,16,64,128,256,2048")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lora", action="store_true", help="4 adapters of rank 16 on every token (Triton LoRA kernels)")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--profile", action="store_true", help="also list the CUDA kernels of one layer forward per path")
    args = ap.parse_args()
    H, I, E, K, L = args.hidden, args.inter, args.experts, args.top_k, args.layers
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    w_gu = [torch.randn(E, 2 * I, H, device=dev, dtype=dt) * H**-0.5 for _ in range(L)]
    w_d = [torch.randn(E, H, I, device=dev, dtype=dt) * I**-0.5 for _ in range(L)]
    gate = [torch.randn(E, H, device=dev, dtype=dt) * H**-0.5 for _ in range(L)]
    expert_bytes = (2 * I * H + H * I) * 2
    ops = (None, None, None)
    if args.lora:
        from moelora.kernels.moe_lora_triton import moe_lora_expand, moe_lora_plan, moe_lora_shrink

        ops = (moe_lora_shrink, moe_lora_expand, moe_lora_plan)
    print(f"H={H} I={I} E={E} top-{K} bf16, {L} layers in rotation, CUDA graphs, lora={args.lora}")
    print(f"{'T':>6} {'experts':>8} {'MB':>8} | {'new µs':>8} {'GB/s':>7} | {'old µs':>8} {'GB/s':>7} | {'speedup':>7}"
          f" | {'rel err':>11}")
    tokens = [int(t) for t in args.tokens.split(",")]
    for T in tokens:
        x = torch.randn(T, H, device=dev, dtype=dt)
        lora = None
        if args.lora:
            S, R = 4, 16
            lora = ExpertLoRAArgs(
                token_slots=(torch.arange(T, device=dev) % S).to(torch.int32),
                gate_up_a=torch.randn(2, S, E, R, H, device=dev, dtype=dt) * 0.01,
                gate_up_b=torch.randn(S, E, 2 * I, R, device=dev, dtype=dt) * 0.01,
                gate_up_scaling=torch.ones(2, S, device=dev), gate_up_ranks=torch.full((2, S), R, dtype=torch.int32, device=dev),
                down_a=torch.randn(1, S, E, R, I, device=dev, dtype=dt) * 0.01,
                down_b=torch.randn(S, E, H, R, device=dev, dtype=dt) * 0.01,
                down_scaling=torch.ones(1, S, device=dev), down_ranks=torch.full((1, S), R, dtype=torch.int32, device=dev),
            )
            lora.gate_up_offsets = torch.tensor([0, I, 2 * I], dtype=torch.int32, device=dev)
            lora.down_offsets = torch.tensor([0, H], dtype=torch.int32, device=dev)
        touched = sum(int(route_topk_ref(x @ gate[li].T, K, True)[1].unique().numel()) for li in range(L)) / L
        mbytes = touched * expert_bytes / 1e6

        def layer(li, new: bool):
            logits = x @ gate[li].T  # [T, E]
            if new:
                w, ids = fmt.route_topk(logits, K, True)
            else:
                w, ids = route_topk_ref(logits, K, True)
            return fused_moe_pairs(x, w_gu[li], w_d[li], w.to(dt), ids, "silu", lora, *ops)

        res = {}
        outs = {}
        for new in (True, False):
            fmt.set_fast_path(new)
            res[new] = graph_time_us(lambda li: layer(li, new), L)
            outs[new] = layer(0, new).float()
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            for new in (True, False):
                fmt.set_fast_path(new)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    layer(0, new)
                    torch.cuda.synchronize()
                kernels = [e for e in prof.events() if str(e.device_type).endswith("CUDA")]
                print(f"  T={T} {'new' if new else 'old'} path: {len(kernels)} GPU ops per layer forward")
                if T == tokens[0]:  # the table for the first T only
                    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
        fmt.set_fast_path(True)
        err = ((outs[True] - outs[False]).norm() / outs[False].norm()).item()
        print(f"{T:>6} {touched:>8.1f} {mbytes:>8.1f} | {res[True]:>8.1f} {mbytes * 1e3 / res[True]:>7.0f} | "
              f"{res[False]:>8.1f} {mbytes * 1e3 / res[False]:>7.0f} | {res[False] / res[True]:>6.2f}x | {err:>11.2e}")
        if args.sweep:
            w, ids = route_topk_ref(x @ gate[0].T, K, True)
            w = w.to(dt)
            P = T * K
            bms = (16,) if P <= 512 else (16, 32, 64) if P <= 4096 else (32, 64, 128)
            configs = [fmt.GemmConfig(bm, bn, bk, nw, ns) for bm in bms for bn in (32, 64, 128)
                       for bk in (64, 128) for nw in (4, 8) for ns in (3, 4) if not (bm * bn > 8192 and nw == 4)]
            timed = []
            for cfg in configs:
                try:
                    us = graph_time_us(lambda li: fmt.fused_moe_triton(x, w_gu[li], w_d[li], w, ids, config=cfg), L, 10)
                except Exception as exc:  # out of shared memory etc.
                    print(f"    {cfg}: {type(exc).__name__}")
                    continue
                timed.append((us, cfg))
            timed.sort(key=lambda r: r[0])
            default = fmt.pick_config(T * K)
            print(f"    experts only; default {default}: "
                  f"{graph_time_us(lambda li: fmt.fused_moe_triton(x, w_gu[li], w_d[li], w, ids), L, 10):.1f} µs; best:")
            for us, cfg in timed[:5]:
                print(f"    {us:8.1f} µs  {cfg}")


if __name__ == "__main__":
    main()
