"""Compile the one-launch deferred dense LoRA chain (kernels/lora_chain_triton.py) for sm_90 on a machine without
a GPU (Triton's bundled ptxas): catches compile errors the interpreter does not see (the counter wait, the stacked
shrink) and prints registers, spills, shared memory and MMA kind per config.

Usage (no TRITON_INTERPRET): python scripts/compile_check_lora_chain.py [--arch 90]
Configs: Qwen3-30B-A3B's qkv (H 2048, 3 slices, split 4) and o_proj (H 4096, 1 slice, split 8) at rank 16, 4 / 8
slot groups, 64 tokens, delta tiles 64 / 128 / 256, 8 warps (at 4 they spill: 255 registers and a stack), each
shrink form (set_lora_chain_shrink: grouped, stacked).
"""

from __future__ import annotations

import argparse
import os

os.environ.pop("TRITON_INTERPRET", None)

from compile_check_lora_fused import compile_one  # noqa: E402

from moelora.kernels import lora_chain_triton as lc  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args()
    types = {n: "*bf16" for n in ("x_ptr", "a_ptr", "b_ptr", "d_ptr")}
    types.update({"h_ptr": "*fp32", "cnt_ptr": "*i32", "off_ptr": "*i32", "ranks_ptr": "*i32", "scale_ptr": "*fp32",
                  "slots_ptr": "*i32", "act_ptr": "*i32", "sorted_ptr": "*i32", "count_ptr": "*i32",
                  "start_ptr": "*i32"})
    for grouped in (True, False):
        for n, sk in ((3, 4), (1, 8)):
            for g in (4, 8):
                for bn in (64, 128, 256):
                    consts = dict(N_SLICES=n, SPLIT_K=sk, BR=16, G=g, BLOCK_M=64, BLOCK_K=128, BLOCK_N=bn,
                                  X_PRECISION="tf32", B_PRECISION="tf32", EVEN_R=True, GROUPED=grouped,
                                  BLOCK_MS=32, BLOCK_RS=16)
                    print(f"shrink {'grouped' if grouped else 'stacked'}:", end=" ")
                    compile_one(lc._lora_chain_kernel, types, consts, ("x_ptr", "a_ptr", "b_ptr", "d_ptr", "h_ptr"),
                                args.arch, num_warps=8)
    consts.update(SPIN_SLEEP=True)  # set_lora_chain_spin_sleep: the inline nanosleep in the counter wait
    print("spin sleep:", end=" ")
    compile_one(lc._lora_chain_kernel, types, consts, ("x_ptr", "a_ptr", "b_ptr", "d_ptr", "h_ptr"), args.arch,
                num_warps=8)


if __name__ == "__main__":
    main()
