"""Compile the fused-MoE Triton kernels for sm_90 (H100/H200) on a machine without a GPU (Triton's bundled
ptxas): catches compile errors the interpreter does not see, and prints per config the shared memory and
whether the K loop got pipelined (cp.async) and which MMA it uses (mma.sync / wgmma).

Usage (no TRITON_INTERPRET): python scripts/compile_check_fused_moe.py [--arch 90]
"""

from __future__ import annotations

import argparse
import os

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from moelora.kernels import fused_moe_triton as fmt  # noqa: E402


def compile_one(fn, types: dict, consts: dict, div16: tuple = (), arch: int = 90, **opts):
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}  # as the JIT specializes
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", arch, 32), options=opts)
    ptx = k.asm["ptx"]
    shown = {n: v for n, v in consts.items() if n.isupper()}
    print(f"{fn.__name__:<22} {shown} {opts} smem={k.metadata.shared} cp.async={ptx.count('cp.async.c')} "
          f"mma={ptx.count('mma.sync')} wgmma={ptx.count('wgmma.mma_async')}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    arch = ap.parse_args().arch
    gemm_types = {"inp_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "sorted_ptr": "*i32", "bexp_ptr": "*i32",
                  "pw_ptr": "*fp32"}
    div16 = ("inp_ptr", "w_ptr", "out_ptr", "sorted_ptr", "bexp_ptr", "pw_ptr", "N", "D", "HALF", "s_im", "s_we", "s_wn", "s_om")
    configs = sorted({fmt.pick_config(p, fuse) for p in (8, 512, 1024, 2048, 4096, 16384) for fuse in (False, True)},
                     key=lambda c: (c.block_m, c.block_n))
    for cfg in configs:
        for fuse in (False, True):
            consts = {"s_id": 1, "s_wd": 1, "s_on": 1, "ROW_DIV": 8, "FUSE_ACT": fuse, "HAS_PW": False, "EVEN_K": True,
                      "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "PRECISION": None}
            compile_one(fmt._expert_gemm_kernel, gemm_types, consts, div16, arch,
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    i32 = {"sorted_ptr": "*i32", "bexp_ptr": "*i32", "counts_ptr": "*i32", "base_ptr": "*i32", "ids_ptr": "*i64"}
    compile_one(fmt._moe_align_kernel, i32, {"BLOCK_M": 16, "BLOCK_P": 128, "BLOCK_E": 128}, arch=arch, num_warps=8)
    compile_one(fmt._align_count_kernel, i32, {"BLOCK_P": 128, "BLOCK_E": 128}, arch=arch, num_warps=4)
    compile_one(fmt._align_offsets_kernel, i32, {"BLOCK_M": 128, "BLOCK_C": 64, "BLOCK_E": 128}, arch=arch, num_warps=8)
    compile_one(fmt._align_place_kernel, i32, {"BLOCK_P": 128, "BLOCK_E": 128}, arch=arch, num_warps=4)
    compile_one(fmt._route_topk_kernel, {"logits_ptr": "*bf16", "w_ptr": "*fp32", "ids_ptr": "*i64"},
                {"K": 8, "BLOCK_E": 128, "BLOCK_K": 8, "RENORM": True}, arch=arch, num_warps=4)
    compile_one(fmt._silu_and_mul_kernel, {"gu_ptr": "*bf16", "out_ptr": "*bf16"}, {"BLOCK": 1024}, arch=arch, num_warps=4)
    compile_one(fmt._combine_kernel, {"o_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16"}, {"K": 8, "BLOCK": 1024},
                arch=arch, num_warps=4)


if __name__ == "__main__":
    main()
