"""Session 24 diagnosis (GPU): one decode step of a 2-layer model at Qwen3-30B-A3B's attention dims (dummy weights,
4 adapters on q/k/v/o, base rows), logits under several dense-LoRA paths, each against the first: the FP8 GEMM's
LoRA epilogue (mode 4, the default), mode 2, the GEMM then lora_expand (no epilogue), set_dense_lora_defer with and
without PDL; on an FP8 and a bf16 base, with a MoE layer and with dense MLPs only (no routing to flip). Prints the
relative distance of each variant to the first, over adapter rows and base rows, and the adapters' own effect."""

import dataclasses
import random
import sys
import tempfile

import torch

sys.path.insert(0, "tests")
from helpers import save_tiny_model  # noqa: E402

from moelora.adapters.metadata import LoRABatch  # noqa: E402
from moelora.config import ModelConfig  # noqa: E402
from moelora.engine.batch import SeqChunk, build_flat_batch  # noqa: E402
from moelora.engine.kv_cache import KVCache  # noqa: E402
from moelora.kernels import _triton, fp8_triton  # noqa: E402
from moelora.models.loader import build_model  # noqa: E402


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def case(quant, mlp_only, batch=48):
    src = tempfile.mkdtemp()
    save_tiny_model("qwen3_moe", src, hidden_size=2048, head_dim=128, num_attention_heads=32, num_key_value_heads=4,
                    moe_intermediate_size=128, intermediate_size=256, num_hidden_layers=2, mlp_only_layers=mlp_only)
    cfg = ModelConfig.from_pretrained(src)
    model = build_model(cfg, dtype=torch.bfloat16, device="cuda", max_loras=4, max_lora_rank=16, load_format="dummy",
                        quantization=quant)
    g = torch.Generator(device="cuda").manual_seed(24)
    for layer in model.model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj):
            w = lin.lora
            for s in range(4):
                for i, out in enumerate(w.out_features):
                    r = (16, 8, 16, 4)[s]
                    w.set_slot(i, s, torch.randn(r, w.in_features, device="cuda", generator=g) * 0.02,
                               torch.randn(out, r, device="cuda", generator=g) * 0.02, 2.0)
    kv = KVCache(cfg, 4096, 16, torch.bfloat16, "cuda")
    for cache in kv.caches:
        for c in cache:
            c.normal_(0, 1, generator=g)
    rng = random.Random(24)
    chunks = []
    for b in range(batch):
        cached = rng.randrange(1, 300)
        chunks.append(SeqChunk([rng.randrange(cfg.vocab_size)], cached, kv.allocate(-(-(cached + 1) // 16)), b % 5 - 1))
    fb = build_flat_batch(chunks, 16, "cuda")
    lora = dataclasses.replace(LoRABatch.build(fb.token_slots, 4, "cuda"), graph=True)
    saved = [c.clone() for cache in kv.caches for c in cache]
    slots = fb.token_slots.cpu() if torch.is_tensor(fb.token_slots) else torch.tensor(fb.token_slots)
    ad = (slots >= 0).cuda()

    @torch.no_grad()
    def step(batch=lora):
        for c, s in zip((c for cache in kv.caches for c in cache), saved):
            c.copy_(s)
        return model.compute_logits(model(fb.input_ids, fb.positions, fb.attn, kv.caches, batch)).clone()

    variants = [("epilogue-m4", {}), ("epilogue-m2", {"split": 2}), ("no-epilogue", {"epi": False}),
                ("defer", {"defer": True}), ("defer-nopdl", {"defer": True, "pdl": False})]
    outs = {}
    for name, v in variants:
        fp8_triton.set_fp8_lora_split(v.get("split", 4))
        fp8_triton.set_fp8_lora_epilogue(v.get("epi", True))
        fp8_triton.set_fp8_lora_pdl(v.get("pdl", True))
        _triton.set_dense_lora_defer(v.get("defer", False))
        outs[name] = step()
    fp8_triton.set_fp8_lora_split(4)
    fp8_triton.set_fp8_lora_epilogue(True)
    fp8_triton.set_fp8_lora_pdl(True)
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


for quant in ("fp8", None):
    for mlp_only in ([1], [0, 1]):
        case(quant, mlp_only)
