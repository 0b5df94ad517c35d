"""Figures other systems published or that we measured on them, shown beside ours in `bench plot`.

Copied from /work/shared/design/FIELD_NOTES.md (project notes; the numbers are theirs, not re-measured by
`bench report`). `kept` = LoRA tokens/s over the same system's no-LoRA tokens/s. `adapters` None = not stated.
`kept` is a (low, high) range where the source gives one.
"""

from __future__ import annotations

SOURCE_SGLANG = "SGLang (published: PRs #28091, #27329 line, MoE-LoRA benchmarks; via FIELD_NOTES.md)"
SOURCE_VLLM = "vLLM 0.26.0 measured on one H200, Qwen3-30B-A3B dims, 128 in / 128 out, 2026-11-30 (FIELD_NOTES.md)"
# the FP8 rows of that run were withdrawn: vLLM's dummy weights round to ~0 in e4m3, the router's softmax became
# uniform and every token took the same 8 experts. Re-measured beside moelora on one H100 with block-scaled FP8:
SOURCE_VLLM_FP8 = ("vLLM 0.26.0 measured beside moelora on one H100, block-scaled FP8, Qwen3-30B-A3B dims, 128 in / "
                   "128 out, 2026-12-06 (FIELD_NOTES.md)")

# share of the no-LoRA throughput kept, per (system, setup, dtype, batch, adapters)
KEPT: list[dict] = [
    *({"system": "SGLang", "setup": "Triton LoRA, bf16 MoE", "dtype": "bf16", "batch": b, "adapters": None,
       "kept": k, "source": SOURCE_SGLANG} for b, k in ((16, 0.57), (32, 0.56), (64, 0.54))),
    *({"system": "SGLang", "setup": "fused TRT-LLM MoE + two streams, bf16", "dtype": "bf16", "batch": b,
       "adapters": None, "kept": k, "source": SOURCE_SGLANG} for b, k in ((16, 0.69), (32, 0.70), (64, 0.73))),
    {"system": "SGLang", "setup": "default Triton, Qwen3.5-35B-A3B-FP8 / Kimi-K2.5-NVFP4", "dtype": "fp8",
     "batch": None, "adapters": None, "kept": (0.62, 0.65), "source": SOURCE_SGLANG},
    {"system": "SGLang", "setup": "experimental fast path, FP8, TP1, mixed traffic", "dtype": "fp8", "batch": None,
     "adapters": 4, "kept": (0.74, 0.79), "source": SOURCE_SGLANG},
    *({"system": "SGLang", "setup": "fast path, Kimi-K2.5-NVFP4, rank 16", "dtype": "nvfp4", "batch": b,
       "adapters": 1, "kept": k, "source": SOURCE_SGLANG} for b, k in ((16, 0.78), (32, 0.85), (64, 0.89), (128, 0.89))),
    {"system": "SGLang", "setup": "Qwen3-30B-A3B TP4, bs 512", "dtype": "bf16", "batch": 512, "adapters": None,
     "kept": 0.43, "source": SOURCE_SGLANG},
    {"system": "vLLM 0.26", "setup": "H200, bf16", "dtype": "bf16", "batch": 64, "adapters": 1, "kept": 0.81, "source": SOURCE_VLLM},
    {"system": "vLLM 0.26", "setup": "H200, bf16", "dtype": "bf16", "batch": 64, "adapters": 4, "kept": 0.74, "source": SOURCE_VLLM},
    {"system": "vLLM 0.26", "setup": "H200, bf16", "dtype": "bf16", "batch": 16, "adapters": 1, "kept": 0.76, "source": SOURCE_VLLM},
    {"system": "vLLM 0.26", "setup": "H200, bf16", "dtype": "bf16", "batch": 16, "adapters": 4, "kept": 0.73, "source": SOURCE_VLLM},
    {"system": "vLLM 0.26", "setup": "H100, fp8 block-scaled", "dtype": "fp8", "batch": 64, "adapters": 4, "kept": 0.68, "source": SOURCE_VLLM_FP8},
]

# vLLM 0.26 decode tokens/s (Qwen3-30B-A3B dims, rank-16 adapters on q/k/v/o + experts): bf16 on the H200
VLLM_TOKENS_PER_S: list[dict] = [
    {"dtype": "bf16", "batch": 64, "adapters": 0, "tokens_per_s": 3644},
    {"dtype": "bf16", "batch": 64, "adapters": 1, "tokens_per_s": 2956},
    {"dtype": "bf16", "batch": 64, "adapters": 4, "tokens_per_s": 2705},
    {"dtype": "bf16", "batch": 16, "adapters": 0, "tokens_per_s": 1286},
    {"dtype": "bf16", "batch": 16, "adapters": 1, "tokens_per_s": 977},
    {"dtype": "bf16", "batch": 16, "adapters": 4, "tokens_per_s": 933},
    # FP8: on an H100 (the card differs from the bf16 rows': compare these with moelora's H100 figures, 4,642 / 4,174)
    {"dtype": "fp8", "batch": 64, "adapters": 0, "tokens_per_s": 4357, "device": "H100"},
    {"dtype": "fp8", "batch": 64, "adapters": 4, "tokens_per_s": 2964, "device": "H100"},
]


def kept_value(entry: dict) -> tuple[float, float, float]:
    """(middle, low, high) of an entry's `kept`, a number or a (low, high) range."""
    k = entry["kept"]
    if isinstance(k, tuple):
        return (k[0] + k[1]) / 2, k[0], k[1]
    return k, k, k
