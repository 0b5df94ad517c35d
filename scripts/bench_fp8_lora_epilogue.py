"""Dense LoRA on an FP8 base, µs per LoRALinear call from CUDA-graph replay (GPU).

One FP8 LoRALinear call at Qwen3-30B-A3B's qkv (2048 -> 4096 + 512 + 512) and o_proj (4096 -> 2048):
  base      without adapters (the activation quantization + the GEMM)
  epilogue  the default with adapters: the shrink into split-K partials, the GEMM with the expand in its epilogue
            (up to 64 rows as one more split-K partial beside the K steps: set_fp8_lora_split mode 2)
  after     the expand after the K steps (set_fp8_lora_split mode 0: the form before session 15)
  split2    mode 2 at any size: the LoRA partial over the batch's slot groups, unrolled (the default's form,
            which applies it only up to 64 rows), with PDL after the shrink where fp8_lora_pdl allows it
  nopdl     the default without programmatic dependent launch (set_fp8_lora_pdl(False))
  separate  MOELORA_FP8_LORA_EPILOGUE=0: the shrink, the GEMM, then the expand kernel
  one_row   the default with one row on an adapter and the rest on none
  single    one adapter only: the single-slot path (plain matmuls on that slot, set_single_slot_fast_path;
            outside CUDA graphs), against `epilogue` with it turned off
Rank 16, max_loras 8, tokens round-robin over the adapters; --layers modules in rotation so L2 does not hold a
layer's weights between calls; --dtype bfloat16: the same on a bf16 base (no epilogue there).
(Session 14 measured four forms of the epilogue with this script, session 15 a mode 1 — the LoRA program over
all slots — and session 16 the shrink inline in the GEMM; the comment in _fp8_gemm_kernel has the figures. --json writes the rows with the date, device and commit.)

    python scripts/bench_fp8_lora_epilogue.py [--tokens 16,64,256,1024,4096] [--adapters 1,4,8] [--json out.json]
    python scripts/bench_fp8_lora_epilogue.py --tokens 16,64,256 --adapters 4,8 --shrink-configs 0x0,16x64,16x128
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch

from moelora.adapters.metadata import LoRABatch
from moelora.bench.common import git_commit, graph_time_us
from moelora.kernels.lora_triton import lora_shrink, lora_shrink_config, set_lora_shrink_config
from moelora.kernels.fp8_triton import fp8_lora_split, set_fp8_lora_epilogue, set_fp8_lora_pdl, set_fp8_lora_split
from moelora.layers.fp8 import Fp8State, to_fp8
from moelora.layers.linear import LoRALinear, dense_lora_h, set_single_slot_fast_path

SHAPES = {"qkv": (2048, [4096, 512, 512]), "o": (4096, [2048])}
MAX_LORAS, RANK = 8, 16


def build(name: str, layers: int, g: torch.Generator, fp8: bool = True) -> list[LoRALinear]:
    D, outs = SHAPES[name]
    mods = []
    for _ in range(layers):
        lin = LoRALinear(D, outs, False, torch.bfloat16, "cuda")
        lin.weight.copy_(torch.randn(sum(outs), D, device="cuda", generator=g) * D**-0.5)
        if fp8:
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
    ap.add_argument("--tokens", default="16,64,256,1024,4096")
    ap.add_argument("--adapters", default="1,4,8")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dtype", default="fp8", choices=["fp8", "bfloat16"],
                    help="the base weights (bfloat16: cuBLAS base, the grouped shrink/expand kernels; no epilogue)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--shrink-configs", default=None,
                    help="comma-separated SPLITSxBLOCK_K dense shrink configurations (0x0: the default) to sweep")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = sweep_shrink(args, g) if args.shrink_configs else run_forms(args, g)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
                   "commit": git_commit(), "dtype": args.dtype, "rows": rows}, f, indent=1)


def sweep_shrink(args: argparse.Namespace, g: torch.Generator) -> list[dict]:
    """The default call (shrink + GEMM with the LoRA program) and the shrink alone, µs, per shrink configuration."""
    configs = [tuple(int(v) for v in c.split("x")) for c in args.shrink_configs.split(",")]
    print(f"{'case':>4} {'T':>5} {'ad':>3} {'config':>7} | {'base':>7} {'call':>7} {'shrink':>7}  (µs per call)")
    rows, default = [], lora_shrink_config()
    for name, mods, T, x, base, n_ad, batch in cases(args, g):
        set_single_slot_fast_path(False)
        try:
            for splits, block_k in configs:
                set_lora_shrink_config(splits, block_k)
                hs = [dense_lora_h(m.lora, x) for m in mods]
                call = graph_time_us(lambda li: mods[li](x, batch), args.layers)
                shrink = graph_time_us(lambda li: lora_shrink(x, mods[li].lora.a, mods[li].lora.rank_tensor,
                                                              batch.groups, hs[li]), args.layers)
                rows.append({"case": name, "tokens": T, "adapters": n_ad, "shrink_splits": hs[0].shape[0],
                             "shrink_block_k": block_k, "base_us": base, "call_us": call, "shrink_us": shrink})
                print(f"{name:>4} {T:>5} {n_ad:>3} {hs[0].shape[0]:>3}x{block_k:<3} | {base:7.1f} "
                      f"{call:7.1f} {shrink:7.1f}")
        finally:
            set_lora_shrink_config(*default)
            set_single_slot_fast_path(True)
    return rows


def cases(args: argparse.Namespace, g: torch.Generator):
    """(name, modules, T, x [T, D], base µs, adapters, LoRABatch of T tokens round-robin over them) for every
    shape, --tokens and --adapters entry; the base (no adapter) timed once per (shape, T)."""
    for name in SHAPES:
        mods = build(name, args.layers, g, args.dtype == "fp8")
        D = SHAPES[name][0]
        for T in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
            base = graph_time_us(lambda li: mods[li](x), args.layers)
            for n_ad in (int(a) for a in args.adapters.split(",")):
                yield name, mods, T, x, base, n_ad, LoRABatch.build([t % n_ad for t in range(T)], MAX_LORAS, "cuda")


def run_forms(args: argparse.Namespace, g: torch.Generator) -> list[dict]:
    rows = []
    print(f"{'case':>4} {'T':>5} {'ad':>3} | {'base':>7} {'epilog':>7} {'after':>7} {'split2':>7} {'nopdl':>7} {'separ':>7} "
          f"{'one_row':>7} {'single':>7}  (µs per call)")
    split_default = fp8_lora_split()
    for name, mods, T, x, base, n_ad, batch in cases(args, g):
        one = LoRABatch.build([-1] * (T - 1) + [0], MAX_LORAS, "cuda")
        set_single_slot_fast_path(False)  # the grouped kernels (what a CUDA graph runs)
        try:
            row = {"case": name, "tokens": T, "adapters": n_ad, "base_us": base,
                   "epilogue_us": graph_time_us(lambda li: mods[li](x, batch), args.layers),
                   "one_row_us": graph_time_us(lambda li: mods[li](x, one), args.layers)}
            for key, mode in (("after_us", 0), ("split2_us", 2)):
                if args.dtype != "fp8":
                    row[key] = None
                    continue
                set_fp8_lora_split(mode, 1 << 30)
                try:
                    row[key] = graph_time_us(lambda li: mods[li](x, batch), args.layers)
                finally:
                    set_fp8_lora_split(*split_default)
            row["nopdl_us"] = None
            if args.dtype == "fp8":
                set_fp8_lora_pdl(False)
                try:
                    row["nopdl_us"] = graph_time_us(lambda li: mods[li](x, batch), args.layers)
                finally:
                    set_fp8_lora_pdl(True)
            set_fp8_lora_epilogue(False)
            try:
                row["separate_us"] = graph_time_us(lambda li: mods[li](x, batch), args.layers)
            finally:
                set_fp8_lora_epilogue(True)
        finally:
            set_single_slot_fast_path(True)
        row["single_slot_us"] = (graph_time_us(lambda li: mods[li](x, batch), args.layers) if n_ad == 1
                                 else None)
        rows.append(row)
        single = f"{row['single_slot_us']:7.1f}" if n_ad == 1 else f"{'':>7}"
        modes = " ".join(f"{row[k]:7.1f}" if row[k] is not None else f"{'':>7}"
                         for k in ("after_us", "split2_us", "nopdl_us"))
        print(f"{name:>4} {T:>5} {n_ad:>3} | {base:7.1f} {row['epilogue_us']:7.1f} {modes} {row['separate_us']:7.1f} "
              f"{row['one_row_us']:7.1f} {single}")
    return rows


if __name__ == "__main__":
    main()
