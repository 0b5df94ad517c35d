"""Compile the FP8 block-scaled GEMM (kernels/fp8_triton.py, _fp8_gemm_kernel) for sm_90 on a machine without a GPU
(Triton's bundled ptxas) at its decode and prefill launch parameters: registers a thread, stack (spills), shared
memory and MMA kind per config (cuobjdump -res-usage on the cubin).

The unit strides (a and the weight along K, the scales along K, the output along N) are passed as the constant 1,
as Triton's JIT specialises them at run time: compiled as runtime integers, every config shows 255 registers and a
stack, and no pipelining (session 33).

Usage (no TRITON_INTERPRET): python scripts/compile_check_fp8_gemm.py [--arch 90]
Result (Triton 3.9, session 33): decode grouped 16 x 64 / 4 warps 92 registers, 30,720 B shared (as on the H200 in
session 13); prefill grouped 128 x 64 / 4 warps (the default) 220, 128 x 128 / 8 warps 235-241, no spills;
128 x 128 / 4 warps and 128 x 256 / 8 warps spill.
"""

from __future__ import annotations

import argparse
import os

os.environ.pop("TRITON_INTERPRET", None)

from compile_check_lora_fused import compile_one  # noqa: E402

from moelora.kernels.fp8_triton import _fp8_gemm_kernel  # noqa: E402

PTRS = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "b_ptr": "*fp8e4nv", "bs_ptr": "*fp32", "c_ptr": "*bf16",
        "bias_ptr": "*bf16", "ids_ptr": "*i32", "bexp_ptr": "*i32", "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
DIV16 = ("a_ptr", "as_ptr", "b_ptr", "bs_ptr", "c_ptr", "ids_ptr", "bexp_ptr", "ws_ptr", "cnt_ptr", "sam", "sbe",
         "sbn", "scm", "N", "K", "sbse")
# (grouped, block_m, block_n, warps, stages, split_k): the decode defaults, then prefill's default and candidates
CONFIGS = [
    (True, 16, 64, 4, 4, 1), (True, 32, 64, 4, 4, 1), (False, 64, 64, 4, 4, 1), (False, 64, 64, 4, 4, 4),
    (True, 128, 64, 4, 4, 1), (True, 128, 128, 4, 3, 1), (True, 128, 128, 8, 3, 1), (True, 128, 128, 8, 4, 1),
    (True, 128, 256, 8, 3, 1), (True, 64, 128, 4, 4, 1),
    (False, 64, 128, 4, 3, 1), (False, 128, 128, 8, 3, 1), (False, 128, 256, 8, 3, 1),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args()
    for grouped, bm, bn, warps, stages, split_k in CONFIGS:
        consts = dict(FP8_MAX_C=448.0, A_FP8=True, GROUPED=grouped, HAS_BIAS=False, GROUP_K=128, SCALE_N=128,
                      BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, A_ROW_DIV=1, SPLIT_K=split_k, LORA_N=0, LORA_SK=1,
                      LORA_BR=16, LORA_PRECISION="ieee", LORA_SPLIT=0, PARTS=split_k,
                      sak=1, sasg=1, sbk=1, sbsk=1, scn=1)
        print(f"{'grouped' if grouped else 'dense':>7} {bm:3d} x {bn:3d} warps {warps} stages {stages} split {split_k}:",
              end=" ", flush=True)
        compile_one(_fp8_gemm_kernel, PTRS, consts, DIV16, args.arch, num_warps=warps, num_stages=stages)


if __name__ == "__main__":
    main()
