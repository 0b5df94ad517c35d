"""Compile the grouped routed-expert LoRA kernel (kernels/moe_lora_grouped_triton.py) for sm_90 on a machine
without a GPU (Triton's bundled ptxas): compile errors the interpreter does not see, and registers, spills, shared
memory and MMA kind per config.

Usage (no TRITON_INTERPRET): python scripts/compile_check_grouped.py [--arch 90]
Configs: Qwen3-30B-A3B at rank 16 (gate_up: D 2048, two 768-wide slices; down: D 768, O 2048), the decode launch
(16-pair blocks, grouped_config) and the prefill launch (64-pair blocks, grouped_prefill_config; gate_up also with
both slices in one program, set_grouped_prefill_fuse_slices), store mode into bf16 and add mode.
"""

from __future__ import annotations

import argparse
import os

os.environ.pop("TRITON_INTERPRET", None)

from compile_check_lora_fused import compile_one  # noqa: E402

from moelora.kernels import moe_lora_grouped_triton as mg  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--warps", default="", help="comma-separated warps to try at prefill (default: the config's)")
    args = ap.parse_args()
    types = {"x_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "off_ptr": "*i32",
             "ranks_ptr": "*i32", "scale_ptr": "*fp32", "ids_ptr": "*i64", "slots_ptr": "*i32", "w_ptr": "*fp32",
             "sorted_ptr": "*i32", "bvex_ptr": "*i32"}
    div16 = ("x_ptr", "a_ptr", "b_ptr", "y_ptr", "D", "sxm", "sa_i", "sa_s", "sa_e", "sa_r", "sb_s", "sb_e", "sb_o",
             "syp")
    decode, prefill = mg.grouped_config(), mg.grouped_prefill_config()
    warps = [int(w) for w in args.warps.split(",")] if args.warps else [prefill.num_warps]
    for site, D, width, per_pair, has_w, n in (("gate_up", 2048, 768, False, False, 2), ("down", 768, 2048, True, True, 1)):
        for block_m, cfg, ns_list, wl in ((mg.GROUPED_BLOCK_M, decode, (1,), [decode.num_warps]),
                                          (mg.PREFILL_BLOCK_M, prefill, (1, 2) if n == 2 else (1,), warps)):
            for ns in ns_list:
                if ns > 1:
                    cfg = mg.PREFILL_FUSED_CONFIG
                for store in (True, False):
                    for w in wl:
                        consts = {"sxd": 1, "sa_d": 1, "sb_r": 1, "syo": 1, "X_PER_PAIR": per_pair, "HAS_W": has_w,
                                  "STORE": store, "SPLIT_HV": True, "BLOCK_M": block_m, "BLOCK_R": 16,
                                  "BLOCK_D": min(cfg.block_d, D), "BLOCK_N": min(cfg.block_n, width), "SPLIT_N": 1,
                                  "PRECISION": None, "EVEN_R": ns == 1, "NS": ns}
                        print(f"{site:<8} block_m={block_m:<3} ns={ns} ", end="")
                        compile_one(mg._moe_lora_grouped_kernel, types, consts, div16, args.arch, num_warps=w,
                                    num_stages=cfg.num_stages)


if __name__ == "__main__":
    main()
