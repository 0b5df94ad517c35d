"""Session 24 diagnosis (GPU): one decode step of a 2-layer model at Qwen3-30B-A3B's attention dims (dummy weights,
4 adapters on q/k/v/o, base rows), logits under several dense-LoRA paths, each against the first: the FP8 GEMM's
LoRA epilogue (mode 4, the default), mode 2, the GEMM then lora_expand (no epilogue), set_dense_lora_defer with and
without PDL; on an FP8 and a bf16 base, with a MoE layer and with dense MLPs only (no routing to flip). Prints the
relative distance of each variant to the first, over adapter rows and base rows, and the adapters' own effect."""

import sys
import tempfile

import torch

sys.path.insert(0, "tests")
from helpers import attention_lora_decode_case  # noqa: E402

from moelora.kernels import _triton, fp8_triton  # noqa: E402


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def case(quant, mlp_only, batch=48):
    model, step, ad = attention_lora_decode_case(tempfile.mkdtemp(), quant, batch, mlp_only_layers=mlp_only)

    variants = [("epilogue-m4", {}), ("epilogue-m2", {"split": 2}), ("no-epilogue", {"epi": False}),
                ("defer", {"defer": True}), ("defer-nopdl", {"defer": True, "pdl": False})]  # the chain's PDL: set_dense_defer_pdl (in call 2: set_fp8_lora_pdl)
    outs = {}
    for name, v in variants:
        fp8_triton.set_fp8_lora_split(v.get("split", 4))
        fp8_triton.set_fp8_lora_epilogue(v.get("epi", True))
        _triton.set_dense_defer_pdl(v.get("pdl", True))
        _triton.set_dense_lora_defer(v.get("defer", False))
        outs[name] = step()
    fp8_triton.set_fp8_lora_split(4)
    fp8_triton.set_fp8_lora_epilogue(True)
    _triton.set_dense_defer_pdl(False)
    _triton.set_dense_lora_defer(False)
    base = step(None)
    ref = outs["epilogue-m4"]
    print(f"== {quant or 'bf16'} base, mlp_only_layers={mlp_only}, batch {batch}: adapters move the logits by "
          f"{rel(ref[ad], base[ad]):.4f} (adapter rows)")
    for name, out in outs.items():
        d = [rel(out[i], ref[i]) for i in range(out.shape[0])]
        big = sum(x > 2**-7 for x in d)
        print(f"  {name:12s} vs epilogue-m4: adapter rows {rel(out[ad], ref[ad]):.5f}, base rows "
              f"{rel(out[~ad], ref[~ad]):.5f}, rows > 2^-7: {big}/{len(d)}; vs no-epilogue {rel(out[ad], outs['no-epilogue'][ad]):.5f}")


with torch.no_grad():
    for quant in ("fp8", None):
        for mlp_only in ([1], [0, 1]):
            case(quant, mlp_only)
