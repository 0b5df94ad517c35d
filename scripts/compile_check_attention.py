"""Compile the paged-attention Triton kernels for sm_90 (H100/H200) on a machine without a GPU (Triton's
bundled ptxas): catches compile errors the interpreter does not see, and prints per kernel the shared
memory, whether the key loop got pipelined (cp.async) and which MMA it uses (mma.sync / wgmma).

Usage (no TRITON_INTERPRET): python scripts/compile_check_attention.py [--arch 90] [--head-dim 128] [--groups 8]
Registers and spills: TRITON_DUMP_PTXAS_LOG=1 TRITON_CACHE_DIR=$(mktemp -d) python scripts/compile_check_attention.py
(on sm_90 at D = 128, G = 8: split 116 regs, prefill 185, no spills; split smem 38 KiB, prefill 96 KiB).
"""

from __future__ import annotations

import argparse
import inspect
import os

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from moelora.kernels.attention import paged_triton as at  # noqa: E402

PTRS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16", "ws_o_ptr": "*fp32",
        "ws_lse_ptr": "*fp32", "cnt_ptr": "*i32", "bt_ptr": "*i32", "token_seq_ptr": "*i32", "seq_lens_ptr": "*i32",
        "qsl_ptr": "*i32", "scale": "fp32", "oq_ptr": "*fp8e4nv", "os_ptr": "*fp32", "la_ptr": "*bf16",
        "lrank_ptr": "*i32", "lslot_ptr": "*i32", "lh_ptr": "*fp32"}
DIV16 = ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "ws_o_ptr", "bt_ptr", "token_seq_ptr", "seq_lens_ptr", "qsl_ptr",
         "sq_t", "sq_h", "sk_b", "sk_s", "sk_h", "sv_b", "sv_s", "sv_h", "so_t", "so_h", "sbt_b")


def compile_one(fn, consts: dict, arch: int, **opts) -> None:
    # constexpr parameters not given keep their defaults (not a runtime i32)
    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.name not in consts
                 and p.default is not inspect.Parameter.empty}, **consts}
    sig = {n: "constexpr" if n in consts else PTRS.get(n, "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in DIV16 if n in fn.arg_names}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", arch, 32), options=opts)
    ptx = k.asm["ptx"]
    shown = {n: v for n, v in consts.items() if n.isupper() and n != "DOT_PRECISION" and (v or n == "DIRECT")}
    print(f"{fn.__name__:<28} {shown} {opts} smem={k.metadata.shared} cp.async={ptx.count('cp.async.c')} "
          f"mma={ptx.count('mma.sync')} wgmma={ptx.count('wgmma.mma_async')} e4m3={ptx.count('e4m3')}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    D, G, BS = args.head_dim, args.groups, args.block_size
    BLOCK_D = max(16, triton.next_power_of_2(D))
    for window in (False, True):
        for direct, quant in ((False, True), (True, False), (True, True)) if window else ((False, False), (True, False)):
            compile_one(at._paged_attn_split_kernel,
                        {"BLOCK_SIZE": BS, "BLOCK_G": max(16, triton.next_power_of_2(G)), "D": D, "BLOCK_D": BLOCK_D,
                         "TILE": at.TILE_N, "HAS_WINDOW": window, "DIRECT": direct, "DOT_PRECISION": "tf32",
                         "QUANT": quant}, args.arch, num_warps=4, num_stages=2)
        BLOCK_G = triton.next_power_of_2(G)
        compile_one(at._paged_attn_prefill_kernel,
                    {"BLOCK_SIZE": BS, "BLOCK_G": BLOCK_G, "BLOCK_M": max(1, at.PREFILL_TILE_ROWS // BLOCK_G),
                     "BLOCK_B": 256, "D": D,
                     "BLOCK_D": BLOCK_D, "TILE": at.TILE_N, "HAS_WINDOW": window, "DOT_PRECISION": "tf32"},
                    args.arch, num_warps=8, num_stages=2)


if __name__ == "__main__":
    main()
