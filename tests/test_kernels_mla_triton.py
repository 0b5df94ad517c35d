"""Triton MLA absorbed decode (attention core over the paged latent cache, kv_b LoRA folded per slot) vs the
torch reference mla_decode_paged_ref, and vs the expanded form. CPU: the interpreter at tiny dims in fp32/fp16;
GPU: DeepSeek-V2-Lite head dims (kv_lora_rank 512, rope 64, nope 128, v 128, 16 heads) in bf16."""

import pytest
import torch

from kernel_cases import DEVICE, DTYPES, NUM_TOKENS, ON_GPU, POPULARITY, token_slots, tolerance
from moelora.kernels.lora.groups import SlotGroups
from moelora.kernels.attention.mla import KVBLoRAArgs, mla_decode_paged_ref, mla_prefill_ref, write_latent_direct, write_latent_ref
from moelora.kernels.attention.mla_triton import mla_decode, mla_decode_attention
from moelora.kernels.quant.split_k_triton import split_counters

LITE = (16, 128, 128, 512, 64)  # DeepSeek-V2-Lite: heads, qk_nope, v_head, kv_lora_rank, qk_rope
DIMS = LITE if ON_GPU else (4, 8, 6, 16, 4)
H, DN, DV, C, R = DIMS
S, RMAX = 4, 16
RANKS = [16, 0, 4, 8]  # slot 1: rank 0 (adds nothing)
SCALING = [0.5, 2.0, 1.5, 0.25]


def _case(T: int, pattern: str, dtype, block_size: int, seed: int = 0, with_padding: bool = True,
          dims: tuple[int, int, int, int, int] | None = None):
    """T decode rows (+2 padding rows), each its own sequence with a random context, blocks shuffled."""
    H, DN, DV, C, R = dims or DIMS
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    lens = torch.randint(1, 40, (T,), generator=gen).tolist()
    nblk = [-(-L // block_size) for L in lens]
    nb = sum(nblk) + 2
    perm = torch.randperm(nb, generator=gen).tolist()
    tables = torch.zeros(T, max(nblk), dtype=torch.int32)
    for b, n in enumerate(nblk):
        tables[b, :n] = torch.tensor([perm.pop() for _ in range(n)])
    cache = rnd(nb, block_size, C + R)
    w = rnd(H * (DN + DV), C) * C**-0.5
    a = torch.zeros(1, S, RMAX, C)
    bb = torch.zeros(S, H * (DN + DV), RMAX)
    for s, r in enumerate(RANKS):
        a[0, s, :r] = rnd(r, C) * C**-0.5
        bb[s, :, :r] = rnd(H * (DN + DV), r) * 0.2
    pad = 2 if with_padding else 0
    slots = torch.cat([token_slots(pattern, T, S, gen), torch.full((pad,), -1, dtype=torch.int32)])
    seq = torch.tensor(list(range(T)) + [-1] * pad, dtype=torch.int32)
    q_nope, q_pe = rnd(T + pad, H, DN), rnd(T + pad, H, R)
    to = lambda x: x.to(DEVICE, dtype)  # noqa: E731
    lora = KVBLoRAArgs(slots.to(DEVICE), to(a), to(bb), torch.tensor([SCALING], device=DEVICE),
                       torch.tensor([RANKS], dtype=torch.int32, device=DEVICE), SlotGroups.build(slots, S, DEVICE))
    meta = (tables.to(DEVICE), seq.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE))
    return to(q_nope), to(q_pe), to(cache), to(w), meta, lora, lens


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_attention_core_matches_reference(dtype, block_size, num_splits):
    q_nope, q_pe, cache, w, (tables, seq, lens_t), _, lens = _case(7, "uniform", dtype, block_size)
    T = q_nope.shape[0]
    q_lat = torch.randn(T, H, C, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    o = mla_decode_attention(q_lat, q_pe, cache, tables, seq, lens_t, 0.3, num_splits)
    for t, L in enumerate(lens):  # plain softmax over the sequence's rows
        blocks = tables[t, : -(-L // block_size)].long()
        rows = cache[blocks].reshape(-1, C + R)[:L].float()
        p = torch.softmax(torch.cat([q_lat[t], q_pe[t]], -1).float() @ rows.T * 0.3, -1)
        atol, rtol = tolerance(dtype)
        torch.testing.assert_close(o[t], p @ rows[:, :C], atol=atol, rtol=rtol)
    assert torch.all(o[len(lens):] == 0), "padding rows: zeros"
    assert not split_counters(o.device, 1).any(), "the splits arriving last reset their arrival counters"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pattern", POPULARITY)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS[:3] if not ON_GPU else NUM_TOKENS)
def test_absorbed_decode_matches_reference(dtype, pattern, num_tokens):
    q_nope, q_pe, cache, w, meta, lora, lens = _case(num_tokens, pattern, dtype, 16, seed=num_tokens)
    scale = (DN + R) ** -0.5
    ref = mla_decode_paged_ref(q_nope.float(), q_pe.float(), cache.float(), w.float(), *meta, scale,
                               KVBLoRAArgs(lora.token_slots, lora.a.float(), lora.b.float(), lora.scaling, lora.ranks))
    got = mla_decode(q_nope, q_pe, cache, w, *meta, scale, lora)
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(got.float(), ref, atol=atol, rtol=rtol)
    base = mla_decode(q_nope, q_pe, cache, w, *meta, scale, None)
    slots = lora.token_slots.cpu()
    for t in range(q_nope.shape[0]):  # slot -1, rank 0 and padding add exactly nothing; the others do
        s = int(slots[t])
        if s < 0 or RANKS[s] == 0:
            assert torch.equal(got[t], base[t]), f"row {t} slot {s}"
        else:
            assert (got[t].float() - base[t].float()).abs().max() > 1e-3, f"row {t} slot {s}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", ["small", "lite"])
def test_absorbed_decode_equals_expanded_with_kv_b_lora(dtype, dims):
    """The Triton absorbed form equals the expanded form (W + scaling B A applied to every latent); "lite":
    DeepSeek-V2-Lite head dims (the kernels' loops over C, Dn and Dv take several tiles)."""
    d = LITE if dims == "lite" else None
    q_nope, q_pe, cache, w, (tables, seq, lens_t), lora, lens = _case(3 if d and not ON_GPU else 5, "distinct", dtype,
                                                                       16, seed=3, with_padding=False, dims=d)
    scale = (q_nope.shape[-1] + q_pe.shape[-1]) ** -0.5
    got = mla_decode(q_nope, q_pe, cache, w, tables, seq, lens_t, scale, lora)
    f = lambda x: x.float()  # noqa: E731
    ref_lora = KVBLoRAArgs(lora.token_slots, f(lora.a), f(lora.b), lora.scaling, lora.ranks)
    expanded = mla_prefill_ref(f(q_nope), f(q_pe), f(cache), f(w), tables, lens, list(range(len(lens) + 1)), scale, ref_lora)
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(got.float(), expanded, atol=atol, rtol=rtol)


def test_write_latent_direct_matches_ref():
    cache, cache_ref = torch.zeros(3, 4, C + R), torch.zeros(3, 4, C + R)
    kv_c, k_pe = torch.randn(3, C), torch.randn(3, R)
    slots = torch.tensor([5, 11, 0])
    write_latent_direct(kv_c, k_pe, cache, slots)
    write_latent_ref(kv_c, k_pe, cache_ref, slots)
    assert torch.equal(cache, cache_ref)


@pytest.mark.skipif(ON_GPU, reason="the GPU runs this path for real (tests/test_deepseek_gpu.py)")
def test_model_device_path_matches_reference(tmp_path, monkeypatch):
    """A tiny DeepSeek-V2 (q_lora_rank, YaRN) with kv_b LoRA on three slots: prefill, then decode steps through
    the device path (unmasked latent writes, Triton absorbed decode under the interpreter) equal the reference
    path; a mixed step (decode rows + a prefill chunk) regroups the decode rows' slots."""
    from helpers import Runner, save_tiny_model
    from moelora.layers.lora_batch import LoRABatch
    from moelora.engine.batch import SeqChunk, build_flat_batch
    from moelora.engine.kv_cache import KVCache

    import moelora.layers.mla as mla_layer

    calls = []
    real = mla_layer.mla_decode
    monkeypatch.setattr(mla_layer, "mla_decode", lambda *a, **kw: calls.append(a[5].shape[0]) or real(*a, **kw))
    torch.set_num_threads(1)
    save_tiny_model("deepseek_v2_q", str(tmp_path / "m"))
    run = Runner(str(tmp_path / "m"), max_loras=4, max_lora_rank=16)
    g = torch.Generator().manual_seed(0)
    for name, t in run.targets.items():
        if name.endswith("kv_b_proj"):
            for slot, r in enumerate(RANKS):
                if r:
                    t.weights.set_slot(t.slice_idx, slot, torch.randn(r, t.in_features, generator=g) * 0.3,
                                       torch.randn(t.out_features, r, generator=g) * 0.3, SCALING[slot])
    model = run.model
    attns = [layer.self_attn for layer in model.model.layers]
    kv = KVCache(run.cfg, 64, 4, torch.float32, "cpu")
    prompts = [[3, 5, 7, 9, 11], [2, 4], [8, 6, 4, 2, 1, 3, 5], [1]]
    slots = [0, 2, -1, 3]
    tables = [kv.allocate(kv.blocks_needed(len(p) + 4, 0)) for p in prompts]

    def step(chunks, device: bool) -> torch.Tensor:
        for a in attns:
            a.device_kernels = device
        fb = build_flat_batch(chunks, 4)
        return model(fb.input_ids, fb.positions, fb.attn, kv.caches, LoRABatch.build(fb.token_slots, 4))

    step([SeqChunk(p, 0, t, s) for p, t, s in zip(prompts, tables, slots)], False)
    lens = [len(p) for p in prompts]
    for k in range(2):
        chunks = [SeqChunk([10 + k + i], lens[i], tables[i], slots[i]) for i in range(4)]
        ref = step(chunks, False)
        got = step(chunks, True)
        assert (got - ref).abs().max() < 1e-4, f"decode step {k}"
        lens = [n + 1 for n in lens]
    chunks = [SeqChunk([20], lens[0], tables[0], slots[0]), SeqChunk([21, 22, 23], lens[1], tables[1], slots[1]),
              SeqChunk([24], lens[2], tables[2], slots[2]), SeqChunk([25], lens[3], tables[3], slots[3])]
    ref = step(chunks, False)
    got = step(chunks, True)
    assert (got - ref).abs().max() < 1e-4, "mixed step"
    layers = run.cfg.num_hidden_layers
    assert calls == [4] * (2 * layers) + [3] * layers  # every layer: 4 decode rows, then the 3 of the mixed step


@pytest.mark.skipif(ON_GPU, reason="the GPU captures real graphs (tests/test_deepseek_gpu.py)")
def test_decode_graph_buffers_through_device_path(tmp_path):
    """StepGraphs' static buffers (bucket 4 for 3 rows: a padding row writing into the dummy block with
    token_seq -1 and slot -1; static LoRA groups, every LoRA layer on) fed eagerly through the MLA device path
    (Triton interpreter) give the eager batch's hidden states: what a captured graph replays."""
    from helpers import save_peft_adapter, save_tiny_model
    from moelora.layers.lora_batch import LoRABatch
    from moelora.engine.batch import SeqChunk, build_flat_batch
    from moelora.engine.cuda_graphs import StepGraphs
    from moelora.engine.llm_engine import EngineArgs, LLMEngine

    torch.set_num_threads(1)
    base = save_tiny_model("deepseek_v2", str(tmp_path / "m"))
    save_peft_adapter(base, str(tmp_path / "a"), 1, r=4, lora_alpha=8, target_modules=["kv_b_proj", "o_proj"])
    eng = LLMEngine(EngineArgs(model=str(tmp_path / "m"), max_loras=2, max_lora_rank=8, max_num_seqs=4,
                               block_size=4, max_model_len=64), {"a": str(tmp_path / "a")})
    model, kv = eng.model, eng.kv
    for layer in model.model.layers:
        layer.self_attn.device_kernels = True
    g = StepGraphs(model, kv, 2, 4, 16)  # not captured (no CUDA): its buffers are run eagerly below
    slots = [eng.pool.acquire(eng.registry.get("a")), -1, 0]
    prompts = [[3, 4, 5, 6, 7], [8, 9], [1, 2, 3]]
    tables = [kv.allocate(kv.blocks_needed(len(p) + 1, 0)) for p in prompts]
    fb = build_flat_batch([SeqChunk(p, 0, t, s) for p, t, s in zip(prompts, tables, slots)], 4)
    model(fb.input_ids, fb.positions, fb.attn, kv.caches, LoRABatch.build(fb.token_slots, 2))
    tokens, lens = [11, 12, 13], [len(p) for p in prompts]
    out = torch.zeros(4, eng.config.hidden_size)

    class Eager:  # stands in for the captured graph: the model on the static buffers
        def replay(self):
            out.copy_(model(g.input_ids[:4], g.positions[:4], g._attn(4, 4, g.qsl), kv.caches, g.lora_batches[4]))

    mode = g.mode(slots)  # the graph the batch takes: an attention-only adapter's
    assert mode == "dense"
    g.graphs[(4, mode)] = (Eager(), out)
    got = g.run(tokens, lens, tables, slots)
    fb = build_flat_batch([SeqChunk([x], n, t, s) for x, n, t, s in zip(tokens, lens, tables, slots)], 4)
    ref = model(fb.input_ids, fb.positions, fb.attn, kv.caches, LoRABatch.build(fb.token_slots, 2))
    assert (got - ref).abs().max() < 1e-4
    dummy = kv.caches[0][0][kv.dummy_block]
    assert dummy.abs().sum() > 0, "the padding row wrote into the dummy block"
