"""Arithmetic shared by `bench report` and `bench plot`: byte floors, shares kept, layer scaling.

Pure functions over plain numbers and row dicts, so they are tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterable


def floor_ms(floor_bytes: float, bandwidth_gbs: float | None) -> float | None:
    """Time to move `floor_bytes` at the measured bandwidth (GB/s), in ms; None without a bandwidth."""
    if not bandwidth_gbs:
        return None
    return floor_bytes / (bandwidth_gbs * 1e9) * 1e3


def step_over_floor(step_ms: float, floor: float | None) -> float | None:
    """Measured step time as a multiple of the byte-floor time (1.0 = at the floor; higher is slower)."""
    if floor is None or floor <= 0:
        return None
    return step_ms / floor


def add_kept(rows: list[dict], key: str = "tokens_per_s") -> None:
    """Set row["kept"] = tokens/s with adapters over tokens/s without, for the same engine and batch.

    Rows are grouped by (model, dtype, rank of the engine, batch); the reference is the row of that group
    with adapters == 0. Rows without a reference get kept = None.
    """
    def group(r: dict) -> tuple:
        return (r.get("model"), r.get("dtype"), r.get("engine_rank"), r.get("batch"))

    base = {group(r): r[key] for r in rows if r.get("adapters") == 0 and r.get(key)}
    for r in rows:
        ref = base.get(group(r))
        r["kept"] = r[key] / ref if ref else None


def scale_to_layers(tokens_per_s: float, measured_layers: int, full_layers: int) -> float:
    """Tokens/s of a run with `measured_layers` layers, scaled to the full model: step time is taken as
    proportional to the layer count (this favours the shortened model slightly: embedding, lm_head and
    sampling do not grow with layers)."""
    return tokens_per_s * measured_layers / full_layers


def split_batch(batch: int, passes: int) -> list[int]:
    """Sizes of `passes` near-equal sub-batches of `batch` (empty ones dropped): one pass per adapter."""
    q, r = divmod(batch, passes)
    return [s for s in (q + (i < r) for i in range(passes)) if s > 0]


def matmul_flops(m: int, n: int, k: int) -> float:
    return 2.0 * m * n * k


def prefill_flop_floor_s(active_params: float, tokens: int, attn_flops_per_token: float, tflops: float | None) -> float | None:
    """Compute floor of a prefill: 2 FLOPs per active weight per token plus attention scores, at the measured
    matmul ceiling (TFLOP/s)."""
    if not tflops:
        return None
    return (2.0 * active_params + attn_flops_per_token) * tokens / (tflops * 1e12)


def mean(xs: Iterable[float]) -> float | None:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None
