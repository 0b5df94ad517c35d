"""Multi-head latent attention (DeepSeek-V2/V3) with LoRA on every projection and a paged latent cache.

Projections (transformers' names): q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj; kv_a_proj_with_mqa (fused
with q_a_proj into `fused_qkv_a_proj` when both exist: one GEMM over the hidden state); kv_a_layernorm;
kv_b_proj; o_proj. The cache holds per token the normalized latent and the rotated shared key. Sequences with
one new token (decode) take the absorbed form, the others (prefill chunks) the expanded form; kv_b_proj's LoRA
enters both in factored form per slot (moelora.kernels.attention.mla).

On a GPU with device metadata (attn.token_seq set) the latent write is unmasked (graph padding rows write into
the cache's dummy block) and decode rows take the Triton absorbed decode (kernels.mla_triton), which reads
token_seq / seq_lens_t / block_tables on the device: a batch of decode rows only, as every CUDA-graph batch is,
reads no host data. Prefill chunks (eager only) keep the expanded reference.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from torch import nn

from moelora.layers.lora_batch import LoRABatch
from moelora.config import ModelConfig
from moelora.kernels.lora.groups import SlotGroups
from moelora.kernels.attention.mla import KVBLoRAArgs, mla_decode_ref, mla_prefill_ref, write_latent_direct, write_latent_ref
from moelora.kernels.attention.mla_triton import mla_decode
from moelora.kernels.attention.rotary import apply_rotary_interleaved_ref, apply_rotary_ref, rotary_cos_sin
from moelora.layers.attention import AttentionMetadata
from moelora.layers.linear import LoRALinear
from moelora.layers.lora import lora_active
from moelora.layers.norm import RMSNorm
from moelora.layers.rotary import RotaryEmbedding

# transformers builds q_a_layernorm and kv_a_layernorm without passing rms_norm_eps: their eps is the default
_LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        m = cfg.mla
        self.num_heads = H = cfg.num_attention_heads
        self.q_lora_rank = m.q_lora_rank
        self.kv_lora_rank, self.nope, self.rope, self.v_dim = m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.scale = m.softmax_scale
        self.rope_interleave, self.rope_fp32 = m.rope_interleave, m.rope_fp32
        self.absorb_decode = True  # False: every sequence takes the expanded form (tests compare the two)
        self.device_kernels: bool | None = None  # None: the Triton path on CUDA; True: also on the CPU (interpreter)
        hidden, qk = cfg.hidden_size, m.qk_head_dim
        kv_a = self.kv_lora_rank + self.rope
        if self.q_lora_rank is None:
            self.q_proj = LoRALinear(hidden, [H * qk], False, dtype, device)
            self.kv_a_proj_with_mqa = LoRALinear(hidden, [kv_a], cfg.qkv_bias, dtype, device)
        else:
            self.fused_qkv_a_proj = LoRALinear(hidden, [self.q_lora_rank, kv_a], cfg.qkv_bias, dtype, device)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LATENT_NORM_EPS, dtype, device)
            self.q_b_proj = LoRALinear(self.q_lora_rank, [H * qk], False, dtype, device)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LATENT_NORM_EPS, dtype, device)
        # kv_b_proj's weight and LoRA slots are read by the MLA ops (never through LoRALinear.forward): they apply
        # it to cached latents, whose slot is their sequence's, not a row of this batch
        self.kv_b_proj = LoRALinear(self.kv_lora_rank, [H * (self.nope + self.v_dim)], False, dtype, device)
        self.o_proj = LoRALinear(H * self.v_dim, [hidden], cfg.o_bias, dtype, device)
        self.rotary = RotaryEmbedding(self.rope, cfg.rope_type, cfg.rope_theta, cfg.hf_config, device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, kv_cache: tuple[torch.Tensor],
                lora: LoRABatch | None) -> torch.Tensor:
        T, H = x.shape[0], self.num_heads
        C, R = self.kv_lora_rank, self.rope
        if self.q_lora_rank is None:
            q = self.q_proj(x, lora)  # [T, H*(Dn+R)]
            kv_a = self.kv_a_proj_with_mqa(x, lora)  # [T, C+R]
        else:
            q_a, kv_a = self.fused_qkv_a_proj(x, lora).split([self.q_lora_rank, C + R], dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(q_a), lora)
        q_nope, q_pe = q.view(T, H, self.nope + R).split([self.nope, R], dim=-1)  # [T, H, Dn], [T, H, R]
        kv_c, k_pe = kv_a.split([C, R], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)  # [T, C]
        q_pe, k_pe = self._rotate(q_pe, k_pe[:, None, :], positions)
        (cache,) = kv_cache
        on_device = (x.is_cuda if self.device_kernels is None else self.device_kernels) and attn.token_seq is not None
        write = write_latent_direct if on_device else write_latent_ref
        write(kv_c, k_pe[:, 0], cache, attn.slot_mapping)
        o = self._attention(q_nope, q_pe, cache, attn, self._kv_b_lora(lora), on_device)  # [T, H, Dv]
        return self.o_proj(o.reshape(T, H * self.v_dim), lora)

    def _rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rotary_cos_sin(positions, self.rotary.inv_freq, self.rotary.attention_scaling)
        if self.rope_interleave:
            return (apply_rotary_interleaved_ref(q, cos, sin, self.rope_fp32),
                    apply_rotary_interleaved_ref(k, cos, sin, self.rope_fp32))
        return apply_rotary_ref(q, cos, sin), apply_rotary_ref(k, cos, sin)

    def _kv_b_lora(self, lora: LoRABatch | None) -> KVBLoRAArgs | None:
        w = self.kv_b_proj.lora
        if not lora_active(w, lora):
            return None
        return KVBLoRAArgs(token_slots=lora.token_slots, a=w.a, b=w.b_cat, scaling=w.scaling, ranks=w.rank_tensor,
                           groups=lora.groups)

    def _attention(self, q_nope, q_pe, cache, attn: AttentionMetadata, lora: KVBLoRAArgs | None,
                   on_device: bool = False) -> torch.Tensor:
        """Decode sequences (one new token) in the absorbed form, the others in the expanded form. Host lists
        (query_start_loc) only pick the form; on the device the decode rows read device metadata only."""
        qsl, lens = attn.query_start_loc, attn.seq_lens
        w = self.kv_b_proj.weight
        n = [qsl[b + 1] - qsl[b] for b in range(len(qsl) - 1)]
        decode = [b for b in range(len(n)) if n[b] == 1 and self.absorb_decode]
        prefill = [b for b in range(len(n)) if n[b] > 0 and b not in decode]
        if on_device and not prefill:  # every CUDA-graph batch
            return self._decode_device(q_nope, q_pe, cache, attn, lora, None)
        if not prefill or not decode:
            op = mla_decode_ref if decode else mla_prefill_ref
            return op(q_nope, q_pe, cache, w, attn.block_tables, lens, qsl, self.scale, lora)
        out = q_nope.new_zeros(q_nope.shape[0], self.num_heads, self.v_dim)
        for seqs, op in ((decode, mla_decode_ref), (prefill, mla_prefill_ref)):
            rows = torch.cat([torch.arange(qsl[b], qsl[b + 1]) for b in seqs]).to(q_nope.device)
            sub_qsl = [0, *itertools.accumulate(n[b] for b in seqs)]
            if on_device and op is mla_decode_ref:
                out[rows] = self._decode_device(q_nope, q_pe, cache, attn, lora, rows)
                continue
            sub_lora = None if lora is None else dataclasses.replace(lora, token_slots=lora.token_slots[rows], groups=None)
            tables = attn.block_tables[torch.tensor(seqs, device=attn.block_tables.device)]
            out[rows] = op(q_nope[rows], q_pe[rows], cache, w, tables, [lens[b] for b in seqs], sub_qsl, self.scale, sub_lora)
        return out

    def _decode_device(self, q_nope, q_pe, cache, attn: AttentionMetadata, lora: KVBLoRAArgs | None,
                       rows: torch.Tensor | None) -> torch.Tensor:
        """Triton absorbed decode of all rows (rows None) or of the decode rows of a mixed eager batch."""
        token_seq = attn.token_seq
        if rows is not None:
            q_nope, q_pe, token_seq = q_nope[rows], q_pe[rows], token_seq[rows]
            if lora is not None:  # eager: regroup the subset's rows by slot on the host
                slots = lora.token_slots[rows]
                lora = dataclasses.replace(lora, token_slots=slots,
                                           groups=SlotGroups.build(slots.cpu(), lora.a.shape[1], slots.device))
        return mla_decode(q_nope, q_pe, cache, self.kv_b_proj.weight, attn.block_tables, token_seq, attn.seq_lens_t,
                          self.scale, lora)
