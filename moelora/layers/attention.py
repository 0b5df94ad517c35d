"""GQA self-attention with a fused qkv projection, optional q/k norms, rotary, and a paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moelora.layers.lora_batch import LoRABatch
from moelora.config import ModelConfig
from moelora.kernels.attention.paged import paged_attention_ref, write_kv_direct, write_kv_ref
from moelora.kernels.attention.paged_triton import decode_kernel_chosen, paged_attention
from moelora.kernels.norm.rmsnorm_triton import qk_norm_rope
from moelora.kernels.quant.fp8 import FP8_DTYPE
from moelora.kernels.quant.fp8_act_triton import act_quant_ok, attach_act_quant
from moelora.layers.fp8 import fp8_act_group
from moelora.layers.linear import LoRALinear, attach_lora_delta
from moelora.layers.norm import RMSNorm
from moelora.layers.rotary import RotaryEmbedding


@dataclass
class AttentionMetadata:
    """Where a flat batch's tokens go in the paged KV cache and what each one may attend to.

    slot_mapping: [T] int64, flat cache index (block * block_size + offset) of each new token, -1 = padding
    block_tables: [B, max_blocks] int32 · seq_lens: host list of B context lengths after this step
    query_start_loc: host list of B + 1 row offsets of each sequence's new tokens in the flat batch"""

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: list[int]
    query_start_loc: list[int]
    # the same on the device, for kernels that must not read host data (GPU, CUDA graphs):
    # token_seq [T] int32 (sequence of each row, -1 = padding), seq_lens_t [B], query_start_loc_t [B+1]
    token_seq: torch.Tensor | None = None
    seq_lens_t: torch.Tensor | None = None
    query_start_loc_t: torch.Tensor | None = None


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.q_size, self.kv_size = cfg.head_dim, cfg.q_size, cfg.kv_size
        self.scale = self.head_dim**-0.5
        self.sliding_window = cfg.sliding_windows[layer_idx]
        self.clip_qkv, self.qk_norm = cfg.clip_qkv, cfg.qk_norm
        self.qkv_proj = LoRALinear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size], cfg.qkv_bias, dtype, device)
        self.o_proj = LoRALinear(self.q_size, [cfg.hidden_size], cfg.o_bias, dtype, device)
        # set by DecoderLayer, whose post-attention norm adds a deferred o_proj LoRA delta (dense_lora.defer)
        self.o_proj_delta_to_norm = False
        if cfg.qk_norm == "head":
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device)
        elif cfg.qk_norm == "full":
            self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps, dtype, device)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_type, cfg.rope_theta, cfg.hf_config, device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor], lora: LoRABatch | None) -> torch.Tensor:
        T = x.shape[0]
        qkv_delta = None
        if self._fused_rope_kv(x, attn) and self.qk_norm != "full" and self.clip_qkv is None:
            # dense_lora.defer: the LoRA delta beside the base GEMM, added by qk_norm_rope below (else None)
            qkv, qkv_delta = self.qkv_proj.forward_deferred(x, lora)
        else:
            qkv = self.qkv_proj(x, lora)  # [T, q + 2 kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.reshape(T, self.num_heads, self.head_dim)
        k = k.reshape(T, self.num_kv_heads, self.head_dim)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        kv_written = False
        if q.is_cuda and self.rotary.fused_ok:  # one kernel: per-head q/k norms (Qwen3), rotary in place, KV writes
            head = self.qk_norm == "head"
            kv_written = attn.token_seq is not None  # the device path: every slot_mapping entry >= 0
            qk_norm_rope(q, k, self.q_norm.weight if head else None, self.k_norm.weight if head else None,
                         self.q_norm.eps if head else 0.0, positions, self.rotary.inv_freq, self.rotary.attention_scaling,
                         kv_write=(v, k_cache, v_cache, attn.slot_mapping) if kv_written else None, delta=qkv_delta)
        else:
            if self.qk_norm == "head":
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary(q, k, positions)
        if q.is_cuda and attn.token_seq is not None:
            if not kv_written:
                write_kv_direct(k, v, k_cache, v_cache, attn.slot_mapping)
            # [T, Hq, D]; padding rows 0 (the decode kernel writes them; the prefill one leaves them as filled here)
            decode = decode_kernel_chosen(T, attn.block_tables.shape[0])
            o = (torch.empty if decode else torch.zeros)(q.shape, dtype=q.dtype, device=q.device)  # contiguous
            o_fp8 = self._o_proj_fp8_buffers(q) if decode else None  # an FP8 o_proj's input, quantized in the kernel
            o_in = o.view(T, self.q_size)  # o_proj's input: the mark below goes on this very object
            paged_attention(q, k_cache, v_cache, attn.block_tables, attn.token_seq, attn.seq_lens_t,
                            attn.query_start_loc_t, self.scale, self.sliding_window, o, out_fp8=o_fp8)
            if o_fp8 is not None:
                attach_act_quant(o_in, *o_fp8, q.shape[2])
            if self.o_proj_delta_to_norm and not self.o_proj._forward_hooks:  # (a hook: e.g. tp's all-reduce)
                y, delta = self.o_proj.forward_deferred(o_in, lora)  # dense_lora.defer, else (o_proj(...), None)
                if delta is not None:
                    attach_lora_delta(y, delta)  # the decoder layer's post-attention norm adds it
                return y
            return self.o_proj(o_in, lora)
        else:
            write_kv_ref(k, v, k_cache, v_cache, attn.slot_mapping)
            o = paged_attention_ref(q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc,
                                    self.scale, self.sliding_window)  # [T, Hq, D]
        return self.o_proj(o.reshape(T, self.q_size), lora)

    def _fused_rope_kv(self, x: torch.Tensor, attn: AttentionMetadata) -> bool:
        """Whether forward takes qk_norm_rope with the KV cache writes (the device path)."""
        return x.is_cuda and self.rotary.fused_ok and attn.token_seq is not None

    def _o_proj_fp8_buffers(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(q [T, Hq * D] e4m3, scales [T, Hq]) for the decode kernel to quantize the attention output into, when
        o_proj is FP8 (Triton) with one scale group per head (group == head dim) and producer quantization is on."""
        T, Hq, D = q.shape
        group = fp8_act_group(self.o_proj)
        if group != D or D & (D - 1) or not act_quant_ok(Hq * D, group, D):
            return None
        return (torch.empty(T, Hq * D, dtype=FP8_DTYPE, device=q.device),
                torch.empty(T, Hq, dtype=torch.float32, device=q.device))
