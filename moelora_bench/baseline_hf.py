"""The transformers + PEFT side of `bench report`: the same mixed-adapter decode workload on a dummy-weight
Hugging Face model of the same configuration, with PEFT LoRA adapters (q/k/v/o and every routed expert's
gate_up/down through `target_parameters`).

PEFT refuses mixed-adapter batches on fused 3-D experts, so a batch of B rows over n adapters runs as n passes
of about B/n rows, one adapter each; a mixed batch is tried too, and measured if PEFT accepts it. Decode time runs
from the first token's logits to the last's (a logits processor notes the times), so it counts decode steps only.
The model may have fewer layers than the real one (time, memory); tokens/s is then scaled to the full layer
count and both numbers are kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from moelora_bench.figures import scale_to_layers, split_batch

ATTN_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def build_hf_model(config: dict, layers: int, device: str | torch.device, dtype: torch.dtype):
    """A transformers model of `config` with `layers` layers and random weights, on `device`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "dtype")}
    hf_cfg = AutoConfig.for_model(config["model_type"], **{**cfg, "num_hidden_layers": layers})
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    return model.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class _StepClock:
    """A logits processor that only notes the time each step's logits are ready (after a device sync)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.times = device, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        _sync(self.device)
        self.times.append(time.perf_counter())
        return scores


def _decode_s(model, ids: torch.Tensor, new_tokens: int, gen_kwargs: dict, **kw) -> float:
    """Seconds of the decode steps of one generate() of exactly `new_tokens` tokens: from the first token's
    logits (the end of the prefill) to the last's, i.e. new_tokens - 1 steps."""
    from transformers import LogitsProcessorList

    clock = _StepClock(ids.device)
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                       logits_processor=LogitsProcessorList([clock]), **gen_kwargs, **kw)
    return max(clock.times[-1] - clock.times[0], 1e-9)


EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "eager")  # grouped_mm: generate() decodes it as batched_mm on a GPU


def _fastest_experts(model, ids: torch.Tensor, gen_kwargs: dict) -> str:
    """transformers' fastest routed-experts implementation for this decode: each candidate times a short
    generate() at the largest batch and the fastest stays set (its fastest generation mode, fairly chosen:
    generate() turns grouped_mm into batched_mm for decoding on a GPU, which copies every token's expert
    weights). Returns a note naming the choice and the timings."""
    timings = {}
    for impl in EXPERTS_IMPLEMENTATIONS:
        try:
            model.set_experts_implementation(impl)
            _decode_s(model, ids, 2, gen_kwargs)  # warm-up of this implementation
            timings[impl] = _decode_s(model, ids, 4, gen_kwargs)
        except Exception as e:  # noqa: BLE001 - an implementation this build or device lacks
            timings[impl] = f"unavailable ({type(e).__name__})"
    usable = {k: v for k, v in timings.items() if isinstance(v, float)}
    if not usable:
        return f"transformers experts implementation: none of {list(timings)} ran ({timings}); left as loaded"
    best = min(usable, key=usable.get)
    model.set_experts_implementation(best)
    shown = ", ".join(f"{k} {v * 1e3:.1f} ms" if isinstance(v, float) else f"{k} {v}" for k, v in timings.items())
    return (f"transformers experts implementation {best!r}, the fastest for 3 decode steps at batch {ids.shape[0]} "
            f"({shown}; generate() decodes grouped_mm as batched_mm on a GPU)")


def run_peft_baseline(
    config: dict, *, full_layers: int, layers: int, batches: list[int], adapter_counts: list[int], rank: int,
    prompt_len: int, new_tokens: int, device: str | torch.device, dtype: torch.dtype = torch.bfloat16,
    mode: str = "default", on_case: Callable[[dict], None] | None = None,
) -> dict:
    """Decode tokens/s of transformers (+ PEFT) for each (batch, adapters). Returns {"rows", "notes", ...}.

    mode: "default" (generate's defaults: dynamic cache; transformers itself switches fused experts to
    batched_mm for decoding) or "static" (static cache, which generate() compiles with torch.compile)."""
    from peft import LoraConfig, get_peft_model

    device = torch.device(device)
    gen_kwargs = {"cache_implementation": "static"} if mode == "static" else {}
    notes: list[str] = []
    torch.manual_seed(0)
    model = build_hf_model(config, layers, device, dtype)
    g = torch.Generator().manual_seed(1)

    def prompts(n: int) -> torch.Tensor:
        return torch.randint(0, config["vocab_size"], (n, prompt_len), generator=g).to(device)

    _decode_s(model, prompts(1), 2, gen_kwargs)  # warm-up
    notes.append(_fastest_experts(model, prompts(max(batches)), gen_kwargs))
    rows = []

    def record(batch: int, n: int, seconds: float, passes: int, mixed: bool) -> None:
        tps = batch * (new_tokens - 1) / seconds
        row = {"batch": batch, "adapters": n, "tokens_per_s_measured": tps,
               "tokens_per_s": scale_to_layers(tps, layers, full_layers), "passes": passes, "mixed_batch": mixed,
               "new_tokens": new_tokens, "decode_s": seconds}
        rows.append(row)
        if on_case:
            on_case(row)

    for b in batches:
        if 0 in adapter_counts:
            record(b, 0, _decode_s(model, prompts(b), new_tokens, gen_kwargs), 1, False)
    counts = [n for n in adapter_counts if n > 0]
    if counts:
        lora = dict(r=rank, lora_alpha=2 * rank, target_modules=ATTN_TARGETS, target_parameters=EXPERT_TARGETS,
                    init_lora_weights=False)
        model = get_peft_model(model, LoraConfig(**lora), adapter_name="ad0")
        for i in range(1, max(counts)):
            model.add_adapter(f"ad{i}", LoraConfig(**lora))
        model.eval()  # get_peft_model leaves it in training mode, where PEFT refuses adapter_names
        _decode_s(model, prompts(1), 2, gen_kwargs)  # warm-up with LoRA
        for b in batches:
            for n in counts:
                seconds, sizes = 0.0, split_batch(b, n)
                for i, size in enumerate(sizes):
                    model.set_adapter(f"ad{i}")
                    seconds += _decode_s(model, prompts(size), new_tokens, gen_kwargs)
                record(b, n, seconds, len(sizes), False)
        if max(counts) > 1:
            # last, because a refused mixed call leaves PEFT's forward hooks behind (the model is dropped after)
            mixed = [n for n in counts if n > 1]
            try:
                _decode_s(model, prompts(2), 2, gen_kwargs, adapter_names=["ad0", "ad1"])
            except Exception as e:  # PEFT 0.21: "lora.ParamWrapper does not support mixed adapter batches yet."
                notes.append(f"PEFT refused a mixed-adapter batch ({type(e).__name__}: {str(e)[:160]}); "
                             "each batch of n adapters ran as n passes of one adapter")
                mixed = []
            for b in batches:
                for n in mixed:
                    names = [f"ad{i % n}" for i in range(b)]
                    record(b, n, _decode_s(model, prompts(b), new_tokens, gen_kwargs, adapter_names=names), 1, True)
    notes.append(f"transformers generate() mode {mode!r}: " + (
        "dynamic cache, SDPA attention, fused experts (transformers switches them to batched_mm for decoding); "
        "--hf-mode static tries a static cache with torch.compile" if mode == "default" else
        "static cache, compiled by generate() with torch.compile (compile time not counted)"))
    if layers != full_layers:
        notes.append(f"transformers + PEFT ran {layers} of {full_layers} layers; tokens_per_s is scaled by "
                     f"{layers}/{full_layers} (tokens_per_s_measured is the raw figure)")
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"layers": layers, "full_layers": full_layers, "rank": rank, "mode": mode, "prompt_len": prompt_len,
            "new_tokens": new_tokens, "dtype": str(dtype).removeprefix("torch."), "rows": rows, "notes": notes}
