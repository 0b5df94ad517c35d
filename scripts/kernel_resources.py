"""Registers, spills, shared memory and warps of every Triton kernel of moelora.kernels compiled by a moelora command
run in this process (GPU; default: `bench decode` at fp8, batch 64, 0 and 4 adapters, two layers: the decode
step's kernels at Qwen3-30B-A3B shapes). Why: a side-stream kernel can only run beside the base expert GEMM if both
fit on an SM at once (65,536 registers, 228 KiB of shared memory, 64 warps); whichever starts first can take a whole
SM's register file. Printed per compiled variant: registers per thread, spills, shared bytes, warps, and the CTAs an
SM can hold by registers, by shared memory and by warps.

    python scripts/kernel_resources.py [--out FILE.json] [-- MOELORA ARGS...]
    python scripts/kernel_resources.py -- bench kernels --quick      # the LoRA kernels of `bench kernels` instead
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import tempfile

import moelora.kernels as kernels_pkg
from moelora.cli import main as moelora_main

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
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="after --: the moelora command to run first")
    args = ap.parse_args()
    command = [a for a in args.command if a != "--"] or [
        "bench", "decode", "--dtype", "fp8", "--batches", "64", "--adapter-counts", "0,4", "--workloads", "vllm",
        "--layers", "2", "--out", tempfile.mkdtemp()]
    rc = moelora_main(command)
    if rc:
        raise SystemExit(rc)
    rows = []
    for info in pkgutil.walk_packages(kernels_pkg.__path__, "moelora.kernels."):
        mod = importlib.import_module(info.name)
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
                kernel = f"{info.name.removeprefix('moelora.kernels.')}.{name}"
                rows.append({"kernel": kernel, "regs": regs, "spills": spills, "shared": shared, "warps": warps,
                             "ctas_per_sm_by_regs": by_regs, "ctas_per_sm_by_shared": by_shared,
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
