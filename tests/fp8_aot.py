"""Compile the FP8 Triton kernels for sm_90 without a GPU (run by test_fp8.py in a subprocess, without the
interpreter): grouped with in-kernel quantization, dense, pre-quantized input, the activation quantization, and the
NVFP4 weight-only GEMM (grouped and dense); and the grouped routed-expert LoRA kernel; the dense LoRA shrink
letting the GEMM start with PDL."""

import inspect

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moelora.kernels.quant.fp8_act_triton import _act_quant_kernel
from moelora.kernels.quant.fp8_triton import _fp8_gemm_kernel
from moelora.kernels.moe.act_triton import _silu_and_mul_kernel
from moelora.kernels.lora.shrink_expand_triton import _shrink_kernel
from moelora.kernels.norm.rmsnorm_triton import _rms_norm_kernel
from moelora.kernels.quant.nvfp4_triton import _nvfp4_gemm_kernel


def compile_sm90(kernel, ptrs: dict, consts: dict, div16=(), **opts):
    """div16: argument names Triton's JIT would see as multiples of 16 (pointers, row strides) at run time."""
    names = kernel.arg_names
    # constexpr parameters not given keep their defaults (not a runtime i32: that would trace both branches)
    consts = {**{p.name: p.default for p in kernel.params if p.is_constexpr and p.name not in consts
                 and p.default is not inspect.Parameter.empty}, **consts}
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


for grouped, block_m, split_k in [(True, 16, 1), (False, 64, 1), (False, 16, 1), (False, 64, 4)]:
    ptrs = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "b_ptr": "*fp8e4nv", "bs_ptr": "*fp32",
            "c_ptr": "*bf16", "bias_ptr": "*bf16", "ids_ptr": "*i32", "bexp_ptr": "*i32", "ws_ptr": "*fp32",
            "cnt_ptr": "*i32"}
    consts = dict(GROUPED=grouped, HAS_BIAS=not grouped, GROUP_K=128, SCALE_N=128,
                  BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=128, A_ROW_DIV=1, SPLIT_K=split_k, LORA_N=0, LORA_SK=1,
                  LORA_BR=16, LORA_PRECISION="ieee", LORA_SPLIT=0, PARTS=split_k)
    ptx = compile_sm90(_fp8_gemm_kernel, ptrs, consts, num_warps=4, num_stages=3).asm["ptx"]
    assert "e4m3" in ptx and ("mma.sync" in ptx or "wgmma" in ptx), (grouped, block_m)
    if split_k > 1:  # the arrival count is a device-scope atomic, after a CTA barrier
        assert "atom" in ptx and "bar.sync" in ptx, "split-K: no atomic count or barrier in the PTX"
    print("ok gemm", grouped, block_m, split_k, "wgmma" if "wgmma" in ptx else "mma.sync")
# the dense GEMM with the multi-LoRA expand in its epilogue (3 slices, the shrink's partials, split-K)
ptrs.update({"lh_ptr": "*fp32", "lb_ptr": "*bf16", "loff_ptr": "*i32", "lrank_ptr": "*i32", "lscale_ptr": "*fp32",
             "lslot_ptr": "*i32"})
consts.update(GROUPED=False, HAS_BIAS=False, BLOCK_M=64, BLOCK_N=64, SPLIT_K=4, LORA_N=3, LORA_SK=8,
              LORA_BR=16, LORA_PRECISION="tf32", PARTS=4)
ptx = compile_sm90(_fp8_gemm_kernel, ptrs, consts, num_warps=4, num_stages=4).asm["ptx"]
assert "e4m3" in ptx and ptx.count("mma") >= 2
print("ok gemm with the LoRA epilogue")
# the grouped expert GEMM at prefill with the routed-expert LoRA expand in its epilogue (set_prefill_lora_epilogue:
# B of the block's expert through slb_e, gate_up's two slices, rows read as p // top_k)
# over all slots (no groups given), the batch's 4 slot groups unrolled, and mode 3 (metadata before the K steps)
for groups, split in [(0, 0), (4, 0), (4, 3)]:
    c = dict(consts, GROUPED=True, BLOCK_M=128, BLOCK_N=128, SPLIT_K=1, LORA_N=2, LORA_SK=1, LORA_PRECISION=None,
             PARTS=1, A_ROW_DIV=8, LORA_GROUPS=groups, LORA_SPLIT=split)
    ptx = compile_sm90(_fp8_gemm_kernel, {**ptrs, "ids_ptr": "*i32", "bexp_ptr": "*i32", "lact_ptr": "*i32"}, c,
                       num_warps=8, num_stages=4).asm["ptx"]
    assert "e4m3" in ptx and ptx.count("mma") >= 2, (groups, split)
print("ok grouped gemm with the routed LoRA epilogue")
ptrs["lact_ptr"] = "*i32"
for split_k, groups in [(1, 0), (1, 8), (4, 8)]:  # the LoRA tile as one more split-K partial (0: over all slots)
    consts.update(SPLIT_K=split_k, LORA_SPLIT=2, PARTS=split_k + 1, LORA_GROUPS=groups)
    ptx = compile_sm90(_fp8_gemm_kernel, ptrs, consts, num_warps=4, num_stages=4).asm["ptx"]
    assert "e4m3" in ptx and ptx.count("mma") >= 2 and "atom" in ptx, (split_k, groups)
    print("ok gemm with the LoRA split", split_k, groups)
# with PDL: the LoRA program waits for the shrink (griddepcontrol.wait), the shrink lets the GEMM start
consts.update(SPLIT_K=1, LORA_SPLIT=2, PARTS=2, LORA_WAIT=True, LORA_GROUPS=8)
ptx = compile_sm90(_fp8_gemm_kernel, ptrs, consts, num_warps=4, num_stages=4, launch_pdl=True).asm["ptx"]
assert "griddepcontrol.wait" in ptx
consts.update(LORA_SPLIT=0, PARTS=4, SPLIT_K=4)  # mode 0: the epilogue waits
assert "griddepcontrol.wait" in compile_sm90(_fp8_gemm_kernel, ptrs, consts, num_warps=4, num_stages=4,
                                             launch_pdl=True).asm["ptx"]
for split_k, groups, even_r in [(1, 8, True), (2, 4, False)]:  # mode 3: the expand's loads before the K steps
    consts.update(LORA_SPLIT=3, SPLIT_K=split_k, PARTS=split_k, LORA_GROUPS=groups, LORA_EVEN_R=even_r)
    k3 = compile_sm90(_fp8_gemm_kernel, ptrs, consts, num_warps=4, num_stages=4, launch_pdl=True)
    ptx = k3.asm["ptx"]
    assert "griddepcontrol.wait" in ptx and ptx.count("mma") >= 2 and ("atom" in ptx) == (split_k > 1)
    print("ok gemm with the LoRA prefetch", split_k, groups, even_r)
for split_k in (1, 2):  # mode 4: the LoRA program first, its tile awaited by a flag (acquire CAS in a loop)
    consts.update(LORA_SPLIT=4, SPLIT_K=split_k, PARTS=split_k + 1, LORA_GROUPS=8, LORA_EVEN_R=True)
    ptx = compile_sm90(_fp8_gemm_kernel, ptrs, consts, num_warps=4, num_stages=4, launch_pdl=True).asm["ptx"]
    assert "griddepcontrol.wait" in ptx and "acquire.gpu.cas" in ptx and "release.exch" in ptx, split_k
    print("ok gemm with the LoRA program first", split_k)
consts.update(LORA_EVEN_R=False)
sh = compile_sm90(_shrink_kernel, {"x_ptr": "*bf16", "a_ptr": "*bf16", "out_ptr": "*fp32", "ranks_ptr": "*i32",
                                   "sorted_ptr": "*i32", "active_ptr": "*i32", "count_ptr": "*i32",
                                   "start_ptr": "*i32"},
                  dict(BLOCK_M=32, BLOCK_R=16, BLOCK_K=64, SPLIT_K=8, PRECISION="ieee", LAUNCH_DEPENDENTS=True),
                  num_warps=4).asm["ptx"]
assert "griddepcontrol.launch_dependents" in sh
print("ok gemm with PDL after the shrink")
consts.update(LORA_SPLIT=0, PARTS=1, LORA_WAIT=False)
q = compile_sm90(_act_quant_kernel, {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
                 dict(FP8_MAX_C=448.0, GROUP=128, BLOCK=128), num_warps=4)
assert "cvt.rn.satfinite.e4m3x2.f32" in q.asm["ptx"]
print("ok act_quant")
# the producers that quantize their own outputs (QUANT_GROUP): a residual-add RMSNorm and SiLU-and-mul
n = compile_sm90(_rms_norm_kernel, {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16",
                                    "ro_ptr": "*bf16", "q_ptr": "*fp8e4nv", "qs_ptr": "*fp32", "eps": "fp32"},
                 dict(HAS_RES=True, BLOCK=2048, QUANT_GROUP=128), num_warps=4)
a = compile_sm90(_silu_and_mul_kernel, {"gu_ptr": "*bf16", "d_ptr": "*fp32", "out_ptr": "*bf16", "q_ptr": "*fp8e4nv",
                                        "qs_ptr": "*fp32"}, dict(HAS_DELTA=True, BLOCK=1024, QUANT_GROUP=128),
                 num_warps=4)
assert all("cvt.rn.satfinite.e4m3x2.f32" in k.asm["ptx"] for k in (n, a))
print("ok producers quantize")
# the deferred dense LoRA (DenseLoRAConfig.defer): the delta kernel (stacked B), the norm and qk_norm_rope adding it
from moelora.kernels.lora.delta_triton import _lora_delta_kernel  # noqa: E402
from moelora.kernels.norm.rmsnorm_triton import _qk_norm_rope_kernel  # noqa: E402

d = compile_sm90(_lora_delta_kernel, {"h_ptr": "*fp32", "b_ptr": "*bf16", "d_ptr": "*bf16", "off_ptr": "*i32",
                                      "ranks_ptr": "*i32", "scale_ptr": "*fp32", "slots_ptr": "*i32", "act_ptr": "*i32"},
                 dict(N_SLICES=3, SK=8, BR=16, G=8, BLOCK_M=32, BLOCK_N=64, PRECISION=None, EVEN_R=True),
                 num_warps=8)
n = compile_sm90(_rms_norm_kernel, {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16",
                                    "ro_ptr": "*bf16", "q_ptr": "*fp8e4nv", "qs_ptr": "*fp32", "eps": "fp32",
                                    "d_ptr": "*bf16"}, dict(HAS_RES=True, BLOCK=2048, QUANT_GROUP=128, HAS_DELTA=True),
                 num_warps=4)
r = compile_sm90(_qk_norm_rope_kernel, {"q_ptr": "*bf16", "k_ptr": "*bf16", "qw_ptr": "*bf16", "kw_ptr": "*bf16",
                                        "pos_ptr": "*i64", "inv_ptr": "*fp32", "eps": "fp32", "scaling": "fp32",
                                        "v_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16", "slot_ptr": "*i64",
                                        "d_ptr": "*bf16"},
                 dict(HALF=64, BLOCK_H=64, NORM=True, WRITE_KV=True, HAS_DELTA=True), num_warps=2)
assert "mma" in d.asm["ptx"]
print("ok dense LoRA deferred: delta kernel, norm and qk_norm_rope adding it")
for grouped, block_m, split_k, decode, row_div in [(True, 16, 1, 0, 1), (False, 64, 4, 1, 1), (True, 16, 1, 2, 8)]:
    ptrs = {"a_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp8e4nv", "s2_ptr": "*fp32", "c_ptr": "*bf16",
            "bias_ptr": "*bf16", "ids_ptr": "*i32", "bexp_ptr": "*i32", "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
    consts = dict(GROUPED=grouped, HAS_BIAS=not grouped, PRECISION=None, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128,
                  EVEN_K=True, DECODE=decode, SPLIT_K=split_k, A_ROW_DIV=row_div,
                  sak=1, swk=1, ssk=1, s2n=1, scn=1)  # unit strides: the JIT specializes them
    ptx = compile_sm90(_nvfp4_gemm_kernel, ptrs, consts, num_warps=4, num_stages=3,
                       div16=[*ptrs, "K", "sam", "swe", "swn", "sse", "ssn", "s2e", "scm"]).asm["ptx"]
    assert "mma" in ptx, (grouped, block_m)
    assert "cp.async.cg.shared.global" in ptx, (grouped, block_m)  # the packed bytes: 16-byte pipelined copies
    assert ("atom.global" in ptx) == (split_k > 1), (grouped, block_m)  # split-K's arrival count
    print("ok nvfp4", grouped, block_m, decode)
# the grouped routed-expert LoRA kernel (not FP8, compiled here beside them), store and add mode; unit strides as
# Triton specializes them, so the input loads are pipelined (cp.async)
from moelora.kernels.moe_lora.grouped_triton import _moe_lora_grouped_kernel  # noqa: E402

names = _moe_lora_grouped_kernel.arg_names
ptrs = {n: "*i32" for n in ("off_ptr", "ranks_ptr", "ids_ptr", "slots_ptr", "sorted_ptr", "bvex_ptr")}
ptrs.update(x_ptr="*bf16", a_ptr="*bf16", b_ptr="*bf16", y_ptr="*fp32", scale_ptr="*fp32", w_ptr="*fp32")
for block_d, store in [(128, True), (256, False)]:
    consts = dict(sxd=1, sa_d=1, sb_r=1, syo=1, X_PER_PAIR=store, HAS_W=store, STORE=store, SPLIT_HV=True,
                  BLOCK_M=16, BLOCK_R=16, BLOCK_D=block_d, BLOCK_N=128, SPLIT_N=1, PRECISION=None, HAS_A_SRC=False)
    div = [n for n in names if n.endswith("_ptr")] + ["D", "sxm", "sa_i", "sa_s", "sa_e", "sa_r", "sb_s", "sb_e",
                                                      "sb_o", "syp"]
    ptx = compile_sm90(_moe_lora_grouped_kernel, ptrs, consts, div16=div, num_warps=4, num_stages=3).asm["ptx"]
    assert "mma" in ptx and "cp.async" in ptx, (block_d, store)
# EVEN_R: B read in whole rank rows (no 2-byte loads; its tiles then copied through cp.async too)
consts.update(EVEN_R=True)
ptx = compile_sm90(_moe_lora_grouped_kernel, ptrs, consts, div16=div, num_warps=4, num_stages=3).asm["ptx"]
assert "mma" in ptx and "ld.global.b16" not in ptx
consts.update(HAS_A_SRC=True)  # MOELORA_LORA_SHARED_A: A read from the slice a_src names
ptx = compile_sm90(_moe_lora_grouped_kernel, {**ptrs, "asrc_ptr": "*i32"}, consts, div16=div, num_warps=4,
                   num_stages=3).asm["ptx"]
assert "mma" in ptx and "cp.async" in ptx
# at prefill (64-pair blocks, 8 warps): the shrink alone for the FP8 expert GEMM's LoRA epilogue (SHRINK_ONLY), one
# slice a program and gate_up's two in one (NS 2)
for ns, shrink_only in [(1, True), (2, True)]:
    c = dict(consts, BLOCK_M=64, BLOCK_N=64, X_PER_PAIR=False, HAS_W=False, STORE=True, HAS_A_SRC=False,
             EVEN_R=False, NS=ns, SHRINK_ONLY=shrink_only)
    ptx = compile_sm90(_moe_lora_grouped_kernel, ptrs, c, div16=div, num_warps=8, num_stages=3).asm["ptx"]
    assert "mma" in ptx and "cp.async" in ptx, (ns, shrink_only)
print("ok grouped lora")
# the per-pair fused routed-expert LoRA kernel (the decode default), its shrink loop pipelined (D_STAGES 3: the A and
# x tiles copied ahead through shared memory)
from moelora.kernels.moe_lora.fused_triton import _moe_lora_fused_kernel  # noqa: E402

names = _moe_lora_fused_kernel.arg_names
ptrs = {n: "*i32" for n in ("off_ptr", "ranks_ptr", "slots_ptr")}
ptrs.update(x_ptr="*bf16", a_ptr="*bf16", b_ptr="*bf16", y_ptr="*fp32", scale_ptr="*fp32", w_ptr="*fp32", ids_ptr="*i64")
consts = dict(sxd=1, sa_d=1, sb_r=1, syo=1, X_PER_PAIR=False, HAS_W=False, STORE=True, BLOCK_R=16, BLOCK_D=256,
              BLOCK_N=256, SPLIT_N=1, D_STAGES=3)
div = ["x_ptr", "a_ptr", "b_ptr", "y_ptr", "D", "sxm", "sa_i", "sa_s", "sa_e", "sa_r", "sb_s", "sb_e", "sb_o", "syp"]
ptx = compile_sm90(_moe_lora_fused_kernel, ptrs, consts, div16=div, num_warps=4).asm["ptx"]
assert "cp.async" in ptx
# EVEN_R (the buffers' rank a power of two): B read in 16-byte vectors, not 2-byte loads (a per-element rank mask)
consts.update(D_STAGES=1, EVEN_R=True)
assert "ld.global.b16" not in compile_sm90(_moe_lora_fused_kernel, ptrs, consts, div16=div, num_warps=4).asm["ptx"]
consts.update(E_STAGES=3, BLOCK_D=512, BLOCK_N=512)  # the expand's B tiles pipelined instead, 2x wider tiles
assert "cp.async" in compile_sm90(_moe_lora_fused_kernel, ptrs, consts, div16=div, num_warps=4).asm["ptx"]
print("ok fused lora, shrink / expand pipelined, B vectorized")
# the default launch (LoRAWeights.a_src): A read from the slice a_src names, both loops pipelined
consts.update(D_STAGES=3, E_STAGES=3, BLOCK_D=256, BLOCK_N=256, HAS_A_SRC=True)
ptx = compile_sm90(_moe_lora_fused_kernel, {**ptrs, "asrc_ptr": "*i32"}, consts, div16=div, num_warps=4).asm["ptx"]
assert "cp.async" in ptx
print("ok fused lora reading A through a_src")
consts.update(SLICE_FIRST=True)  # MOELORA_FUSED_LORA_SLICE_FIRST: grid (slice, pair, split)
ptx = compile_sm90(_moe_lora_fused_kernel, {**ptrs, "asrc_ptr": "*i32"}, consts, div16=div, num_warps=4).asm["ptx"]
assert "cp.async" in ptx
print("ok fused lora, slices of a pair side by side")
# the base experts' alignment at decode sizes: a histogram and each pair placed by an atomic add (no sort)
from moelora.kernels.moe.align_triton import _moe_align_kernel  # noqa: E402

ptx = compile_sm90(_moe_align_kernel, {"ids_ptr": "*i64", "slots_ptr": "*i64", "sorted_ptr": "*i32",
                                       "bexp_ptr": "*i32", "shift_ptr": "*i32"},
                   dict(BLOCK_M=16, BLOCK_P=512, BLOCK_E=256, HAS_SLOTS=False), num_warps=4).asm["ptx"]
assert "atom" in ptx and "bitonic" not in ptx
print("ok moe_align placing by atomics")
# rank 128 (max_lora_rank 128): decode and prefill launches fit an H100's shared memory (227 KB)
from moelora.kernels.moe_lora.grouped_triton import (  # noqa: E402
    GROUPED_BLOCK_M, GROUPED_CONFIG, PREFILL_BLOCK_M, PREFILL_CONFIG, fit_shared_memory)

names = _moe_lora_grouped_kernel.arg_names
ptrs = {n: "*i32" for n in ("off_ptr", "ranks_ptr", "ids_ptr", "slots_ptr", "sorted_ptr", "bvex_ptr")}
ptrs.update(x_ptr="*bf16", a_ptr="*bf16", b_ptr="*bf16", y_ptr="*bf16", scale_ptr="*fp32", w_ptr="*fp32")
div = [n for n in names if n.endswith("_ptr")] + ["D", "sxm", "sa_i", "sa_s", "sa_e", "sa_r", "sb_s", "sb_e", "sb_o",
                                                  "syp"]
for block_m, cfg in [(GROUPED_BLOCK_M, GROUPED_CONFIG), (PREFILL_BLOCK_M, PREFILL_CONFIG)]:
    c = dict(sxd=1, sa_d=1, sb_r=1, syo=1, X_PER_PAIR=True, HAS_W=False, STORE=True, SPLIT_HV=True, BLOCK_M=block_m,
             BLOCK_R=128, BLOCK_D=cfg.block_d, BLOCK_N=cfg.block_n, SPLIT_N=1, PRECISION=None, HAS_A_SRC=False,
             EVEN_R=True)
    k = compile_sm90(_moe_lora_grouped_kernel, ptrs, c, div16=div, num_warps=cfg.num_warps,
                     num_stages=fit_shared_memory(128, cfg))
    assert k.metadata.shared <= 232448, (block_m, k.metadata.shared)
print("ok grouped lora at rank 128 fits shared memory")
