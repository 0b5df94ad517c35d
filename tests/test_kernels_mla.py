"""MLA reference ops (expanded prefill vs absorbed decode, kv_b LoRA per slot) and the DeepSeek router op
(against transformers' DeepseekV2/V3 routers and a per-token loop), fp32 on the CPU."""

import pytest
import torch

from helpers import deepseek_tiny
from moelora.config import ModelConfig
from moelora.kernels.attention.mla import KVBLoRAArgs, mla_decode_ref, mla_prefill_ref, write_latent_ref
from moelora.kernels.moe.routing import grouped_topk_ref

H, DN, DV, C, R, S, RMAX, BS = 4, 8, 6, 16, 4, 4, 16, 4
RANKS = [4, 0, 8, 16]  # slot 1: rank 0 (adds nothing)
SCALING = [0.5, 2.0, 1.5, 0.25]
POPULARITY = {
    "distinct": [0, 1, 2, 3, 0, 2],
    "identical": [2] * 6,
    "with_base_rows": [-1, 2, -1, 3, 0, -1],
}


def _setup(q_lens: list[int], seq_slots: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    ctx = [q + extra for q, extra in zip(q_lens, [4, 9, 0, 13, 2, 6])]  # context lengths after this step
    nblk = [(L + BS - 1) // BS for L in ctx]
    perm = torch.randperm(sum(nblk) + 3, generator=g).tolist()  # non-contiguous, out-of-order blocks
    tables = torch.zeros(len(ctx), max(nblk), dtype=torch.int32)
    k = 0
    for b, n in enumerate(nblk):
        tables[b, :n] = torch.tensor(perm[k : k + n])
        k += n
    cache = rnd(sum(nblk) + 3, BS, C + R)
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    T = qsl[-1]
    q_nope, q_pe = rnd(T, H, DN), rnd(T, H, R)
    w = rnd(H * (DN + DV), C) * 0.3
    a = torch.zeros(1, S, RMAX, C)
    bb = torch.zeros(S, H * (DN + DV), RMAX)
    for s, r in enumerate(RANKS):
        a[0, s, :r] = rnd(r, C) * 0.3
        bb[s, :, :r] = rnd(H * (DN + DV), r) * 0.3
    token_slots = torch.tensor([s for s, q in zip(seq_slots, q_lens) for _ in range(q)], dtype=torch.int32)
    lora = KVBLoRAArgs(token_slots=token_slots, a=a, b=bb, scaling=torch.tensor([SCALING]),
                       ranks=torch.tensor([RANKS], dtype=torch.int32))
    return q_nope, q_pe, cache, w, tables, ctx, qsl, lora


@pytest.mark.parametrize("popularity", list(POPULARITY))
@pytest.mark.parametrize("q_lens", [[1] * 6, [1, 3, 1, 2, 1, 5]], ids=["decode", "mixed"])
def test_absorbed_equals_expanded(popularity, q_lens):
    slots = POPULARITY[popularity]
    q_nope, q_pe, cache, w, tables, ctx, qsl, lora = _setup(q_lens, slots)
    scale = 0.3
    expanded = mla_prefill_ref(q_nope, q_pe, cache, w, tables, ctx, qsl, scale, lora)
    absorbed = mla_decode_ref(q_nope, q_pe, cache, w, tables, ctx, qsl, scale, lora)
    assert (absorbed - expanded).abs().max() < 1e-5
    # the semantics: each sequence sees kv_b_proj with its own slot's LoRA product merged in (this oracle only)
    base = mla_prefill_ref(q_nope, q_pe, cache, w, tables, ctx, qsl, scale, None)
    base_absorbed = mla_decode_ref(q_nope, q_pe, cache, w, tables, ctx, qsl, scale, None)
    for b, s in enumerate(slots):
        rows = slice(qsl[b], qsl[b + 1])
        merged = w if s < 0 else w + SCALING[s] * lora.b[s] @ lora.a[0, s]
        one = mla_prefill_ref(q_nope[rows], q_pe[rows], cache, merged, tables[b : b + 1], [ctx[b]], [0, q_lens[b]], scale)
        assert (expanded[rows] - one).abs().max() < 1e-5, f"sequence {b} (slot {s})"
        if s < 0 or RANKS[s] == 0:  # slot -1 and rank 0 add exactly nothing
            assert torch.equal(absorbed[rows], base_absorbed[rows]) and torch.equal(expanded[rows], base[rows])
        else:
            assert (absorbed[rows] - base_absorbed[rows]).abs().max() > 1e-3


def test_write_latent_skips_padding():
    cache = torch.zeros(3, BS, C + R)
    kv_c, k_pe = torch.randn(3, C), torch.randn(3, R)
    write_latent_ref(kv_c, k_pe, cache, torch.tensor([5, -1, 0]))
    flat = cache.view(-1, C + R)
    assert torch.equal(flat[5], torch.cat([kv_c[0], k_pe[0]])) and torch.equal(flat[0], torch.cat([kv_c[2], k_pe[2]]))
    assert flat[torch.arange(flat.shape[0]) != 5][1:].abs().sum() == 0  # nothing else written


# ----------------------------------------------------------------------------------------------------------------
# routing


@pytest.mark.parametrize("variant", ["deepseek_v2", "deepseek_v2_q", "deepseek_v3"])
def test_router_matches_transformers(variant):
    from moelora.layers.deepseek_moe import DeepseekRouter

    hf_cfg, _ = deepseek_tiny(variant)
    if variant == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter as Router
    else:
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter as Router
    torch.manual_seed(0)
    ref = Router(hf_cfg)
    cfg = ModelConfig.from_hf(hf_cfg)
    ours = DeepseekRouter(cfg, torch.float32, "cpu")
    with torch.no_grad():
        ref.weight.normal_(0, 1.0)
        ours.weight.copy_(ref.weight)
        if variant == "deepseek_v3":
            ref.e_score_correction_bias.normal_(0, 0.5)
            ours.e_score_correction_bias.copy_(ref.e_score_correction_bias)
    x = torch.randn(257, cfg.hidden_size)
    _, w_ref, ids_ref = ref(x)
    w, ids = ours(x)
    order_ref, order = ids_ref.argsort(-1), ids.argsort(-1)
    assert torch.equal(ids_ref.gather(1, order_ref), ids.gather(1, order))
    assert (w_ref.gather(1, order_ref) - w.gather(1, order)).abs().max() < 1e-6
    r = cfg.routing
    if r.topk_method != "greedy":  # the group limit (and V3's bias) really changes which experts win
        scores = torch.nn.functional.linear(x, ours.weight)
        _, plain = grouped_topk_ref(scores, cfg.num_experts_per_tok, r.scoring_func, "greedy", 1, 1, False, 1.0)
        assert (plain.sort(-1).values != ids.sort(-1).values).any(-1).float().mean() > 0.1
    if cfg.norm_topk_prob:
        assert torch.allclose(w.sum(-1), torch.full((257,), r.routed_scaling_factor), atol=1e-5)


def _loop_topk(logits, k, scoring, method, n_group, topk_group, renorm, factor, bias):
    """One token at a time, in plain python over experts: the op's docstring, literally."""
    T, E = logits.shape
    per = E // n_group
    ws, ids = [], []
    for t in range(T):
        s = logits[t].softmax(-1) if scoring == "softmax" else logits[t].sigmoid()
        choice = s + bias if method == "noaux_tc" else s.clone()
        if method != "greedy":
            gs = [sorted(choice[g * per : (g + 1) * per].tolist())[-2:] for g in range(n_group)]
            gscore = [sum(v) if method == "noaux_tc" else v[-1] for v in gs]
            keep = sorted(range(n_group), key=lambda g: -gscore[g])[:topk_group]
            for g in range(n_group):
                if g not in keep:
                    choice[g * per : (g + 1) * per] = float("-inf") if method == "noaux_tc" else 0.0
        top = sorted(range(E), key=lambda e: -choice[e].item())[:k]
        w = torch.stack([s[e] for e in top])
        if renorm:
            w = w / (w.sum() + 1e-20)
        ws.append(w * factor)
        ids.append(top)
    return torch.stack(ws), torch.tensor(ids)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy", "noaux_tc"])
@pytest.mark.parametrize("renorm", [False, True])
def test_grouped_topk_semantics(scoring, method, renorm):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(33, 16, generator=g) * 2
    bias = torch.randn(16, generator=g) * 0.3
    args = (logits, 3, scoring, method, 4, 2, renorm, 2.5, bias)
    w, ids = grouped_topk_ref(*args)
    w_ref, ids_ref = _loop_topk(*args)
    o, o_ref = ids.argsort(-1), ids_ref.argsort(-1)
    assert torch.equal(ids.gather(1, o), ids_ref.gather(1, o_ref))
    assert (w.gather(1, o) - w_ref.gather(1, o_ref)).abs().max() < 1e-6
