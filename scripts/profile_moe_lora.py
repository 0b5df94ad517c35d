"""Profile one prefill-sized routed-expert LoRA case (alignment + tiled shrink/expand) on the GPU:
prints the CUDA kernels and their times, to see where the time over the byte floor goes."""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from moelora.kernels.moe_lora_triton import moe_lora_expand, moe_lora_plan, moe_lora_shrink


def main(T: int = 64, S: int = 4, R: int = 16, variant: str = "tiled") -> None:
    E, K, H, inter = 128, 8, 2048, 768
    dev, dt = "cuda", torch.bfloat16
    slots = (torch.arange(T) % S).to(torch.int32).to(dev)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).to(dev)
    x = torch.randn(T, H, device=dev, dtype=dt)
    a = torch.randn(2, S, E, R, H, device=dev, dtype=dt) * 0.01
    b = torch.randn(S, E, 2 * inter, R, device=dev, dtype=dt) * 0.01
    ranks = torch.full((2, S), R, dtype=torch.int32, device=dev)
    scaling = torch.ones(2, S, device=dev)
    off = torch.tensor([0, inter, 2 * inter], dtype=torch.int32, device=dev)
    y = torch.randn(T * K, 2 * inter, device=dev, dtype=dt)
    h = torch.zeros(T * K, 2, R, device=dev)

    def run():
        h.zero_()
        align = moe_lora_plan(ids, slots, E, S) if variant == "tiled" else None
        moe_lora_shrink(x, a, ranks, ids, slots, E, h, False, variant=variant, align=align)
        moe_lora_expand(h, b, off, ranks, scaling, ids, slots, E, y, variant=variant, align=align)

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            run()
        torch.cuda.synchronize()
    print(f"T={T} adapters={S} rank={R} variant={variant} (10 runs)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main(*(int(a) if a.isdigit() else a for a in sys.argv[1:]))
