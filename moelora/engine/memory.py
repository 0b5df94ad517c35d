"""GPU memory planning: weights, adapter slots, activations, CUDA-graph pool and KV cache within
`gpu_memory_utilization` of the device's memory.

The budget is this engine's, as vLLM's: what was in use before it built (`memory_baseline`) is not in it. Order
at start-up: the baseline; weights and adapter slot buffers (`used`: the growth since); one profiling forward of
the largest step (max_num_batched_tokens tokens, LoRA kernels on) measures the activation peak; the CUDA-graph pool
is reserved from that peak scaled to the largest captured decode batch; the KV cache gets the rest.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from moelora.layers.lora_batch import LoRABatch
from moelora.engine.batch import build_flat_batch, dummy_chunks, split_tokens
from moelora.engine.kv_cache import KVCache
from moelora.models.registry import kv_cache_shapes

GIB = 1 << 30
GRAPH_MARGIN = 256 << 20  # graph outputs, cuBLAS workspaces, allocator rounding


@dataclass
class MemoryPlan:
    total: int  # device memory
    budget: int  # gpu_memory_utilization * total
    used: int  # before the KV cache, this engine's since its baseline: weights, adapter slots, its other buffers
    activations: int  # peak of the largest step
    graph_reserve: int  # kept free for the CUDA-graph pool
    kv_bytes: int
    num_blocks: int
    baseline: int = 0  # in use on the device before the engine started: other processes, the CUDA context

    def as_gib(self) -> dict[str, float]:
        return ({k: round(v / GIB, 3) for k, v in asdict(self).items() if k != "num_blocks"}
                | {"num_blocks": self.num_blocks})


class GPUMemoryError(RuntimeError):
    """The parts of the GPU memory plan do not fit the budget; the message names each part and what to change."""


def memory_baseline(a, device: torch.device) -> int:
    """What kv_blocks will plan around (a: EngineArgs): on a GPU without kv_cache_memory_bytes, the bytes in use on
    it before the engine builds (other processes, the CUDA context; this process's freed cache returned first);
    else 0. Not checked against the budget: the plan bounds the KV cache by the memory then free."""
    if not (a.kv_cache_memory_bytes is None and device.type == "cuda"):
        return 0
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def plan_kv_blocks(total: int, used: int, activations: int, graph_reserve: int, utilization: float, per_block: int,
                   cap: int, baseline: int = 0, free: int | None = None) -> MemoryPlan:
    """KV blocks that fit: (utilization * total - used - activations - graph_reserve) // per_block, at most cap,
    and no more than free (now, if given) less the activations and the graph pool; used: this engine's growth since
    its baseline. Raises a GPUMemoryError naming every part when not even one block fits."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = int(utilization * total)
    kv = budget - used - activations - graph_reserve
    if free is not None:
        kv = min(kv, free - activations - graph_reserve)
    n = min(max(kv, 0) // per_block, cap)
    if n < 1:
        raise GPUMemoryError(
            f"GPU memory budget exceeded: gpu_memory_utilization {utilization} x {total / GIB:.2f} GiB = "
            f"{budget / GIB:.2f} GiB, but weights + adapter slots already use {used / GIB:.2f} GiB "
            f"(besides the {baseline / GIB:.2f} GiB in use before this engine started), "
            f"activations of the largest step {activations / GIB:.2f} GiB and the CUDA-graph pool "
            f"{graph_reserve / GIB:.2f} GiB, leaving {kv / GIB:.2f} GiB for a KV cache whose blocks take "
            f"{per_block / 2**20:.2f} MiB each. Raise --gpu-memory-utilization, or lower --max-num-batched-tokens, "
            "--max-loras / --max-lora-rank, --max-graph-batch-size (or --enforce-eager).")
    return MemoryPlan(total, budget, used, activations, graph_reserve, int(n * per_block), int(n), baseline)


@torch.no_grad()
def profile_activations(model, cfg, num_tokens: int, max_loras: int, block_size: int, max_model_len: int,
                        max_num_seqs: int, device: torch.device) -> int:
    """Peak bytes allocated by one forward of num_tokens prompt tokens (sequences of at most max_model_len,
    tokens spread over every LoRA slot, LoRA kernels forced on) plus fp32 logits of max_num_seqs rows. The KV cache
    it writes is a temporary one of just enough blocks."""
    lens = split_tokens(num_tokens, max(1, min(num_tokens, max_model_len - 1)))
    num_blocks = sum(-(-n // block_size) for n in lens)
    caches = [tuple(torch.zeros(s, dtype=model.dtype, device=device) for s in layer)
              for layer in kv_cache_shapes(cfg, num_blocks + 1, block_size)]
    fb = build_flat_batch(dummy_chunks(lens, 0, block_size, num_blocks), block_size, device)
    lora = LoRABatch.every_slot(num_tokens, max_loras, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    hidden = model(fb.input_ids, fb.positions, fb.attn, caches, lora)
    model.compute_logits(hidden[: min(num_tokens, max_num_seqs)])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del hidden, caches, fb, lora
    torch.cuda.empty_cache()
    return int(peak)


def kv_blocks(model, kv_config, a, max_model_len: int, device: torch.device,
              baseline: int = 0) -> tuple[int, MemoryPlan | None]:
    """KV blocks of this rank: on a GPU without kv_cache_memory_bytes, what the memory plan leaves after one
    profiling forward (its MemoryPlan returned too); else kv_cache_memory_bytes (256 MiB on the CPU by default).
    Never more than max_num_seqs full sequences. kv_config: this rank's KV shapes (kv_cache_config); a: EngineArgs;
    baseline: memory_baseline before the model was built."""
    per_block = KVCache.bytes_per_block(kv_config, a.block_size, model.dtype)
    cap = a.max_num_seqs * -(-max_model_len // a.block_size)  # no more than max_num_seqs full sequences
    if a.kv_cache_memory_bytes is None and device.type == "cuda":
        tokens = max(a.max_num_batched_tokens, 1)
        act = profile_activations(model, kv_config, tokens, a.max_loras, a.block_size, max_model_len,
                                  a.max_num_seqs, device)
        graphs = not a.enforce_eager and getattr(model, "supports_cuda_graphs", False)
        graph_tokens = max(a.max_graph_batch_size, a.max_prefill_graph_tokens)  # the largest graph's activations
        graph_reserve = (act * min(1.0, graph_tokens / tokens) + GRAPH_MARGIN) if graphs else 0
        free, total = torch.cuda.mem_get_info(device)
        plan = plan_kv_blocks(total, max(total - free - baseline, 0), act, int(graph_reserve),
                              a.gpu_memory_utilization, per_block, cap, baseline, free)
        return plan.num_blocks, plan
    budget = a.kv_cache_memory_bytes if a.kv_cache_memory_bytes is not None else 256 << 20
    n = min(budget // per_block, cap)
    if n < 1:
        raise RuntimeError(f"KV cache budget of {budget} bytes holds no block of {per_block} bytes; raise it")
    return int(n), None
