"""Compile the fused decode LoRA kernels (moe_lora_fused_triton.py, lora_fused_triton.py) for sm_90 (H100/H200)
on a machine without a GPU (Triton's bundled ptxas): catches compile errors the interpreter does not see, and
prints per config the registers per thread, stack / local bytes (spills; cuobjdump -res-usage on the cubin),
shared memory and MMA kind.

Usage (no TRITON_INTERPRET): python scripts/compile_check_lora_fused.py [--arch 90]
Configs: what the launchers pick for Qwen3-30B-A3B at rank 16/32/64/128 (gate_up: D 2048, O 768 per slice;
down: D 768, O 2048; dense qkv: H 2048, widest slice 4096, T 1/16/64/128/256), add and store mode.
Result (Triton 3.9, sm_90): no spills anywhere; MoE kernel 56-64 registers, no MMA (GEMV), 256-1024 B smem;
dense kernel 64-178 registers at BLOCK_M 16/32 (mma.sync), 166-245 at BLOCK_M 64 (wgmma), 16-72 KiB smem.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from moelora.kernels import lora_fused_triton as lf  # noqa: E402
from moelora.kernels import moe_lora_fused_triton as mf  # noqa: E402


def _res_usage(cubin: bytes) -> str:
    """'regs=N local=L' (L > 0: spills or a stack) from cuobjdump -res-usage on the cubin (Triton's bundled
    cuobjdump; its bundled ptxas may be older than the PTX version Triton emits, so the cubin is read instead)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        r = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", r.stdout)
    return f"regs={m.group(1)} stack={m.group(2)} local={m.group(3)}" if m else "regs=?"


def compile_one(fn, types: dict, consts: dict, div16: tuple, arch: int, **opts) -> None:
    # constexpr parameters with a default (switches added after this script: HAS_A_SRC, SHARED_H, ...) at it
    consts = {**{q.name: q.default for q in fn.params if q.is_constexpr and q.default is not inspect.Parameter.empty
                 and q.name not in consts}, **consts}
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16 if n in fn.arg_names}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", arch, 32), options=opts)
    ptx = k.asm["ptx"]
    shown = {n: v for n, v in consts.items() if n.isupper() and n != "PRECISION"}
    print(f"{fn.__name__:<26} {shown} warps={opts.get('num_warps')} y={types.get('y_ptr')} {_res_usage(k.asm['cubin'])} smem={k.metadata.shared} "
          f"mma={ptx.count('mma.sync')} wgmma={ptx.count('wgmma.mma_async')}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    arch = ap.parse_args().arch
    H, I = 2048, 768
    moe_types = {"x_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "off_ptr": "*i32", "ranks_ptr": "*i32",
                 "scale_ptr": "*fp32", "ids_ptr": "*i64", "slots_ptr": "*i32", "w_ptr": "*fp32"}
    moe_div16 = ("x_ptr", "a_ptr", "b_ptr", "y_ptr", "D", "sxm", "sa_i", "sa_s", "sa_e", "sa_r", "sb_s", "sb_e",
                 "sb_o", "syp")
    for R in (16, 32, 64, 128):
        for site, D, width, per_pair, has_w, n in (("gate_up", H, I, False, False, 2), ("down", I, H, True, True, 1)):
            for T in (1, 16, 64, 128, 256):
                warps = mf.fused_num_warps(T * 8 * n)
                block_r, block_d, block_n = mf.fused_blocks(R, D, width, warps)
                for store, y_t in ((False, "*bf16"), (True, "*fp32")):
                    consts = {"sxd": 1, "sa_d": 1, "sb_r": 1, "syo": 1, "X_PER_PAIR": per_pair, "HAS_W": has_w,
                              "STORE": store, "BLOCK_R": block_r, "BLOCK_D": block_d, "BLOCK_N": block_n, "SPLIT_N": 2}
                    compile_one(mf._moe_lora_fused_kernel, {**moe_types, "y_ptr": y_t}, consts, moe_div16, arch,
                                num_warps=warps)
    dense_types = {"x_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "off_ptr": "*i32", "ranks_ptr": "*i32",
                   "scale_ptr": "*fp32", "sorted_ptr": "*i32", "active_ptr": "*i32", "count_ptr": "*i32",
                   "start_ptr": "*i32"}
    dense_div16 = ("x_ptr", "a_ptr", "b_ptr", "y_ptr", "H", "sxm", "sa_i", "sa_s", "sa_r", "sb_s", "sb_o", "sym")
    for R in (16, 64, 128):
        for T in (1, 16, 64, 128, 256):
            bm, block_r, block_k, block_n = lf.fused_dense_blocks(T, R, H, 4096)
            for store, y_t in ((False, "*bf16"), (True, "*fp32")):
                consts = {"sxk": 1, "sa_k": 1, "sb_r": 1, "syo": 1, "STORE": store, "BLOCK_M": bm, "BLOCK_R": block_r,
                          "BLOCK_K": block_k, "BLOCK_N": block_n, "SPLIT_N": 2, "BLOCK_L": 16, "PRECISION": None}
                compile_one(lf._lora_fused_decode_kernel, {**dense_types, "y_ptr": y_t}, consts, dense_div16, arch,
                            num_warps=4)


if __name__ == "__main__":
    main()
