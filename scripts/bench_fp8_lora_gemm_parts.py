"""Where the dense FP8 GEMM's LoRA time goes (GPU), µs per call from CUDA-graph replay, at Qwen3-30B-A3B's qkv
(2048 -> 4096 + 512 + 512) and o_proj (4096 -> 2048), rank 16, max_loras 8, tokens round-robin over the adapters:
  gemm        fp8_linear alone, x already quantized (what the decode step runs without adapters)
  m0/m2/m3/m4 fp8_linear with the LoRA expand (h computed beforehand, no PDL), set_fp8_lora_split mode 0 / 2 / 3 / 4
  m3_rank0    mode 3 with every rank 0 (no B or h read: the kernel's form alone)
  m2_rank0    modes 2 and 4 likewise
  m4_rank0
  shrink      lora_shrink alone
  call        the LoRALinear call as the engine runs it (shrink, then the GEMM with PDL), modes 2, 3 and 4
(Session 22: a decode layer's trace showed the GEMM with LoRA ~6 µs longer than without, with h precomputed too.)

    python scripts/bench_fp8_lora_gemm_parts.py [--tokens 64] [--adapters 4,8] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json

import torch

from moelora.adapters.metadata import LoRABatch
from moelora.bench.common import git_commit, graph_time_us
from moelora.kernels.fp8_triton import Fp8LoRAEpilogue, fp8_linear, fp8_lora_split, quantize_act_group, set_fp8_lora_split
from moelora.kernels.lora_triton import lora_shrink
from moelora.layers.linear import dense_lora_h

from bench_fp8_lora_epilogue import MAX_LORAS, SHAPES, build  # noqa: E402  (scripts/ on sys.path when run as a script)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="64")
    ap.add_argument("--adapters", default="4,8")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    default = fp8_lora_split()
    cols = ["gemm", "m0", "m2", "m3", "m4", "m2_rank0", "m3_rank0", "m4_rank0", "shrink", "call_m2", "call_m3",
            "call_m4"]
    print(f"{'case':>4} {'T':>5} {'ad':>3} | " + " ".join(f"{c:>8}" for c in cols) + "  (µs per call)")
    for name in SHAPES:
        mods = build(name, args.layers, g)
        D = SHAPES[name][0]
        for T in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
            xq, xs = quantize_act_group(x, 128)
            for n_ad in (int(a) for a in args.adapters.split(",")):
                batch = LoRABatch.build([t % n_ad for t in range(T)], MAX_LORAS, "cuda")
                hs = [dense_lora_h(m.lora, x) for m in mods]
                for m, h in zip(mods, hs):
                    lora_shrink(x, m.lora.a, m.lora.rank_tensor, batch.groups, h)
                epis = [Fp8LoRAEpilogue(h, m.lora.b_cat, m.lora.slice_offsets, m.lora.rank_tensor, m.lora.scaling,
                                        batch.groups.token_slots, batch.groups.active_slots, False,
                                        tuple(m.lora.slice_offsets_host)) for m, h in zip(mods, hs)]
                zero = torch.zeros_like(mods[0].lora.rank_tensor)
                epis0 = [dataclasses.replace(e, ranks=zero) for e in epis]

                def gemm(li, lora=None):
                    m = mods[li]
                    return fp8_linear(xq, m.weight, m.weight_scale_inv, m.quant.block, None, x_scale=xs, lora=lora,
                                      out_dtype=torch.bfloat16)

                row = {"case": name, "tokens": T, "adapters": n_ad}
                row["gemm"] = graph_time_us(gemm, args.layers)
                for mode in (0, 2, 3, 4):
                    set_fp8_lora_split(mode, 1 << 30)
                    try:
                        row[f"m{mode}"] = graph_time_us(lambda li: gemm(li, epis[li]), args.layers)
                        if mode:
                            row[f"m{mode}_rank0"] = graph_time_us(lambda li: gemm(li, epis0[li]), args.layers)
                        if mode:
                            row[f"call_m{mode}"] = graph_time_us(lambda li: mods[li](x, batch), args.layers)
                    finally:
                        set_fp8_lora_split(*default)
                row["shrink"] = graph_time_us(lambda li: lora_shrink(x, mods[li].lora.a, mods[li].lora.rank_tensor,
                                                                     batch.groups, hs[li]), args.layers)
                rows.append(row)
                print(f"{name:>4} {T:>5} {n_ad:>3} | " + " ".join(f"{row[c]:8.1f}" for c in cols), flush=True)
    print_compiled()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
                       "commit": git_commit(), "rows": rows}, f, indent=1)


def print_compiled() -> None:
    """Registers and spills of each compiled _fp8_gemm_kernel variant (from Triton's cache of this process)."""
    from moelora.kernels.fp8_triton import _fp8_gemm_kernel

    try:
        caches = _fp8_gemm_kernel.device_caches
        for dev, entry in caches.items():
            for key, k in entry[0].items():
                k._init_handles() if hasattr(k, "_init_handles") else None
                print(f"compiled: regs {getattr(k, 'n_regs', '?')} spills {getattr(k, 'n_spills', '?')} "
                      f"shared {k.metadata.shared} stages {k.metadata.num_stages} key {str(key)[-160:]}")
    except Exception as e:  # the cache layout differs between Triton versions: informational only
        print(f"compiled: not listed ({type(e).__name__}: {e})")


if __name__ == "__main__":
    main()
