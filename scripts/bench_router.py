"""The MoE router at decode sizes (GPU), µs per call from CUDA-graph replay, at Qwen3-30B-A3B's router (E 128,
H 2048, top-8, bf16): F.linear + route_topk (the default path) against router_triton.router_topk (one launch) in
several launch configurations. 128 distinct gates are cycled (64 MB, past the L2), as 48 layers' gates are
between two reads in a decode step.

    python scripts/bench_router.py [--tokens 16,64,128,256] [--json out.json]
        [--configs "BTxKSxBExBHxW,..."]   (0: the default of each)
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch
import torch.nn.functional as F

from moelora.bench.common import git_commit, graph_time_us
from moelora.kernels import router_triton as rt
from moelora.kernels.fused_moe_triton import route_topk

E, H, K, GATES = 128, 2048, 8, 128
CONFIGS = ",".join(rt.ROUTER_CONFIGS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="16,64,128,256")
    ap.add_argument("--configs", default=CONFIGS)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    gates = [torch.randn(E, H, device="cuda", dtype=torch.bfloat16, generator=g) * H ** -0.5 for _ in range(GATES)]
    rt.set_fused_router(True)
    rows = []
    print(f"{'T':>4} {'config':>18} {'µs':>7} {'vs F.linear+route_topk':>24}")
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
        assert rt.router_topk_ok(x, gates[0])

        def base(i: int) -> None:
            route_topk(F.linear(x, gates[i]), K, True, x.dtype)

        ref_us = graph_time_us(base, GATES)
        rows.append({"tokens": T, "config": "F.linear+route_topk", "us": ref_us})
        print(f"{T:>4} {'F.linear+route_topk':>18} {ref_us:7.2f}")
        ids_ref = route_topk(F.linear(x, gates[0]), K, True, x.dtype)[1]
        for cfg in args.configs.split(","):
            rt.set_router_config(*(int(v) for v in cfg.split("x")))
            w, ids, _ = rt.router_topk(x, gates[0], K, True)
            same = float((ids == ids_ref).float().mean())  # near-ties may differ in the last bit of a logit
            us = graph_time_us(lambda i: rt.router_topk(x, gates[i], K, True), GATES)
            rows.append({"tokens": T, "config": cfg, "us": us, "ids_same": same})
            print(f"{T:>4} {cfg:>18} {us:7.2f} {us / ref_us:23.2f}x  ids same {same:.4f}")
        rt.set_router_config()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kind": "bench_router", "date": datetime.date.today().isoformat(),
                       "device": torch.cuda.get_device_name(), "commit": git_commit(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
