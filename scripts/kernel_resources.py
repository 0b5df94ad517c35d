"""Registers, spills, shared memory and warps of every compiled Triton kernel in moelora.kernels after the decode
cases of two benchmarks (GPU): scripts/bench_lora_fused.py (routed-expert LoRA at 64 tokens, 4 adapters, rank 16)
and scripts/bench_fp8_kernels.py (the FP8 expert and dense GEMMs). Why: a side-stream kernel can only run beside
the base expert GEMM if both fit on an SM at once (65,536 registers, 228 KiB of shared memory, 64 warps); whichever
starts first can take a whole SM's register file. Printed per compiled variant: registers per thread, spills,
shared bytes, warps, and the CTAs an SM can hold by registers, by shared memory and by warps.

    python scripts/kernel_resources.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import runpy
import sys

import moelora.kernels as kernels_pkg

HERE = os.path.dirname(os.path.abspath(__file__))
SM_REGS, SM_SHARED, SM_WARPS = 65536, 228 * 1024, 64


def compiled_variants(fn) -> list:
    """The CompiledKernel objects of a triton JITFunction (Triton 3.x keeps them per device)."""
    out = []
    caches = getattr(fn, "device_caches", None)
    if caches:
        for entry in caches.values():
            cache = entry[0] if isinstance(entry, tuple) else entry
            out.extend(cache.values())
    for cache in (getattr(fn, "cache", None) or {}).values():
        if isinstance(cache, dict):
            out.extend(cache.values())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    argv = sys.argv
    sys.argv = ["bench_lora_fused.py", "--tokens", "64", "--adapters", "4", "--ranks", "16", "--cases", "gate_up,down"]
    runpy.run_path(os.path.join(HERE, "bench_lora_fused.py"), run_name="__main__")
    sys.argv = ["bench_fp8_kernels.py"]
    runpy.run_path(os.path.join(HERE, "bench_fp8_kernels.py"), run_name="__main__")
    sys.argv = argv
    rows = []
    for info in pkgutil.iter_modules(kernels_pkg.__path__):
        mod = importlib.import_module(f"moelora.kernels.{info.name}")
        for name, fn in vars(mod).items():
            if not hasattr(fn, "run") or not name.startswith("_"):
                continue
            for ck in compiled_variants(fn):
                if hasattr(ck, "_init_handles"):
                    ck._init_handles()
                regs, spills = int(getattr(ck, "n_regs", 0)), int(getattr(ck, "n_spills", 0))
                meta = ck.metadata
                warps, shared = int(meta.num_warps), int(meta.shared)
                threads = 32 * warps
                by_regs = SM_REGS // max(1, regs * threads) if regs else None
                by_shared = SM_SHARED // shared if shared else None
                rows.append({"kernel": f"{info.name}.{name}", "regs": regs, "spills": spills, "shared": shared,
                             "warps": warps, "ctas_per_sm_by_regs": by_regs, "ctas_per_sm_by_shared": by_shared,
                             "ctas_per_sm_by_warps": SM_WARPS // warps})
    for r in rows:
        print(f"{r['kernel']:60s} regs {r['regs']:3d} spills {r['spills']:3d} shared {r['shared']:6d} warps "
              f"{r['warps']:2d}  CTAs/SM by regs {r['ctas_per_sm_by_regs']} shared {r['ctas_per_sm_by_shared']} "
              f"warps {r['ctas_per_sm_by_warps']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
