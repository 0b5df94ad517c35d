"""The dense LoRA epilogue of the FP8 GEMM, per mode, µs per call from CUDA-graph replay (GPU).

Session 13's profile: at batch 64 with 4 adapters the FP8 GEMMs take +0.70 ms a step (+0.95 with 8) with LoRA,
~7 µs per dense GEMM, against ~4-5 µs for the GEMM itself. This times one FP8 LoRALinear call (the activation
quantization, the shrink into split-K partials, the GEMM with the expand in its epilogue) at Qwen3-30B-A3B's qkv
(2048 -> 4096 + 512 + 512) and o_proj (4096 -> 2048) for each epilogue mode (set_fp8_lora_epilogue_mode), beside:
  base      the same call without adapters (quantization + GEMM)
  one_row   the LoRA call with one row on an adapter, the rest on none (the LoRA path's fixed cost)
  separate  MOELORA_FP8_LORA_EPILOGUE=0's path: the shrink, the GEMM, then the expand kernel
Rank 16, max_loras 8, tokens round-robin over the adapters; --layers modules in rotation so L2 does not hold a
layer's weights between calls.

    python scripts/bench_fp8_lora_epilogue.py [--tokens 16,64,256] [--adapters 1,4,8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from moelora.adapters.metadata import LoRABatch
from moelora.bench.common import graph_time_us
from moelora.kernels.fp8_triton import LORA_EPILOGUE_MODES, set_fp8_lora_epilogue, set_fp8_lora_epilogue_mode
from moelora.layers.fp8 import Fp8State, to_fp8
from moelora.layers.linear import LoRALinear

SHAPES = {"qkv": (2048, [4096, 512, 512]), "o": (4096, [2048])}
MAX_LORAS, RANK = 8, 16


def build(name: str, layers: int, g: torch.Generator) -> list[LoRALinear]:
    D, outs = SHAPES[name]
    mods = []
    for _ in range(layers):
        lin = LoRALinear(D, outs, False, torch.bfloat16, "cuda")
        lin.weight.copy_(torch.randn(sum(outs), D, device="cuda", generator=g) * D**-0.5)
        to_fp8(lin, Fp8State((128, 128), torch.bfloat16, None), quantize=True)
        lin.enable_lora(MAX_LORAS, RANK)
        for s in range(MAX_LORAS):
            for i, o in enumerate(outs):
                lin.lora.set_slot(i, s, torch.randn(RANK, D, device="cuda", generator=g) * 0.05,
                                  torch.randn(o, RANK, device="cuda", generator=g) * 0.05, 2.0)
        mods.append(lin)
    return mods


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="16,64,256")
    ap.add_argument("--adapters", default="1,4,8")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"{'case':>4} {'T':>4} {'ad':>3} | {'base':>6} {'one_row':>7} {'separ':>6} | "
          + " ".join(f"{m:>7}" for m in LORA_EPILOGUE_MODES) + "  (µs per call)")
    for name in SHAPES:
        mods = build(name, args.layers, g)
        D = SHAPES[name][0]
        for T in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
            base = graph_time_us(lambda li: mods[li](x), args.layers)
            for n_ad in (int(a) for a in args.adapters.split(",")):
                batch = LoRABatch.build([t % n_ad for t in range(T)], MAX_LORAS, "cuda")
                none = LoRABatch.build([-1] * (T - 1) + [0], MAX_LORAS, "cuda")  # one row: the LoRA path runs
                row = {"case": name, "tokens": T, "adapters": n_ad, "base_us": base,
                       "one_row_us": graph_time_us(lambda li: mods[li](x, none), args.layers)}
                set_fp8_lora_epilogue(False)
                try:
                    row["separate_us"] = graph_time_us(lambda li: mods[li](x, batch), args.layers)
                finally:
                    set_fp8_lora_epilogue(True)
                ref = None
                for mode in LORA_EPILOGUE_MODES:
                    set_fp8_lora_epilogue_mode(mode)
                    try:
                        row[f"{mode}_us"] = graph_time_us(lambda li: mods[li](x, batch), args.layers)
                        out = mods[0](x, batch)
                    finally:
                        set_fp8_lora_epilogue_mode("hoist")
                    ref = out if ref is None else ref
                    row[f"{mode}_equal"] = bool(torch.equal(out, ref))
                rows.append(row)
                print(f"{name:>4} {T:>4} {n_ad:>3} | {base:6.1f} {row['one_row_us']:7.1f} {row['separate_us']:6.1f} | "
                      + " ".join(f"{row[f'{m}_us']:7.1f}" for m in LORA_EPILOGUE_MODES)
                      + ("" if all(row[f"{m}_equal"] for m in LORA_EPILOGUE_MODES) else "  NOT bit-equal"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
