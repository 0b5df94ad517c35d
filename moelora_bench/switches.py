"""In-process A/B of MOELORA_* switches for `bench decode --ab`: parse the variants, set a switch through its
setter (what the environment variable sets at import), and read it back to restore it.

One process measures every variant on the same GPU, weights and requests, between graph recaptures: differences
between machines (~1.4% on the H200s lent here) and start-up costs drop out of the comparison.
"""

from __future__ import annotations

from typing import Callable


Switch = tuple[Callable[[str], None], Callable[[], str], tuple[str, ...]]  # (set, get, the values it takes)


def _bool_switch(module: str, setter: str, getter: str) -> Switch:
    def set_(value: str) -> None:
        getattr(_import(module), setter)(value == "1")

    def get() -> str:
        return "1" if getattr(_import(module), getter)() else "0"

    return set_, get, ("0", "1")


def _import(module: str):
    import importlib

    return importlib.import_module(module)


def _delta_dtype() -> Switch:
    def set_(value: str) -> None:
        _import("moelora.kernels._triton").set_lora_delta_dtype(value)

    def get() -> str:
        import torch

        return "fp32" if _import("moelora.kernels._triton").lora_delta_dtype(torch.bfloat16) == torch.float32 \
            else "activation"

    return set_, get, ("activation", "fp32")


def _fp8_lora_split() -> Switch:
    def set_(value: str) -> None:
        _import("moelora.kernels.quant.fp8_triton").set_fp8_lora_split(int(value))

    def get() -> str:
        return str(_import("moelora.kernels.quant.fp8_triton").fp8_lora_split()[0])

    return set_, get, ("0", "2", "3", "4")


def _shrink_splits() -> Switch:
    def set_(value: str) -> None:
        lt = _import("moelora.kernels.lora.shrink_expand_triton")
        lt.set_lora_shrink_config(int(value), lt.lora_shrink_config()[1])

    def get() -> str:
        return str(_import("moelora.kernels.lora.shrink_expand_triton").lora_shrink_config()[0])

    return set_, get, ("0", "1", "2", "4", "8")


def _shrink_block_k() -> Switch:
    def set_(value: str) -> None:
        lt = _import("moelora.kernels.lora.shrink_expand_triton")
        lt.set_lora_shrink_config(lt.lora_shrink_config()[0], int(value))

    def get() -> str:
        return str(_import("moelora.kernels.lora.shrink_expand_triton").lora_shrink_config()[1])

    return set_, get, ("0", "32", "64", "128", "256")


def _int_switch(module: str, setter: str, getter: str, values: tuple[str, ...]) -> Switch:
    def set_(value: str) -> None:
        getattr(_import(module), setter)(int(value))

    def get() -> str:
        return str(getattr(_import(module), getter)())

    return set_, get, values


_T = "moelora.kernels._triton"
# env name -> (set from the env string, current value as an env string, accepted values); each one is read when
# graphs are captured
SWITCHES: dict[str, Switch] = {
    "MOELORA_DENSE_LORA_DEFER": (lambda v: _import(_T).set_dense_lora_defer(v), lambda: _import(_T).dense_lora_defer(),
                                 ("0", "1", "fp8")),
    "MOELORA_LORA_SHRINK_SPLITS": _shrink_splits(),
    "MOELORA_LORA_SHRINK_BLOCK_K": _shrink_block_k(),
    "MOELORA_MOE_LORA_EARLY": (lambda v: _import(_T).set_moe_lora_early(v), lambda: _import(_T).moe_lora_early_mode(),
                               ("0", "1", "2")),
    "MOELORA_MOE_LORA_EARLY_DOWN": _bool_switch(_T, "set_moe_lora_early_down", "moe_lora_early_down"),
    "MOELORA_SIDE_STREAM_PRIORITY": (lambda v: _import("moelora.kernels.streams").set_side_stream_priority(v),
                                     lambda: _import("moelora.kernels.streams").side_stream_priority_override(),
                                     ("high", "normal")),
    "MOELORA_LORA_SHRINK_WARPS": _int_switch("moelora.kernels.lora.shrink_expand_triton", "set_lora_shrink_warps",
                                             "lora_shrink_warps", ("0", "1", "2", "4", "8")),
    "MOELORA_LORA_EXPAND_PREFILL_TILE": (
        lambda v: _import("moelora.kernels.lora.shrink_expand_triton").set_lora_expand_prefill_tile(v),
        lambda: _import("moelora.kernels.lora.shrink_expand_triton").lora_expand_prefill_tile(),
        ("0x0x0", "128x128x8", "128x64x4", "64x128x4", "128x128x4")),
    "MOELORA_LORA_DELTA_WARPS": _int_switch("moelora.kernels.lora.delta_triton", "set_lora_delta_warps",
                                            "lora_delta_warps", ("0", "1", "2", "4", "8")),
    "MOELORA_DENSE_DEFER_K_PER_SPLIT": _int_switch(_T, "set_dense_defer_k_per_split", "dense_defer_k_per_split",
                                                   ("0", "256", "512", "1024")),
    "MOELORA_GROUPED_PREFILL": _bool_switch("moelora.kernels.moe_lora.grouped_triton", "set_grouped_prefill",
                                            "grouped_prefill"),
    "MOELORA_GROUPED_PREFILL_FUSE_SLICES": _bool_switch("moelora.kernels.moe_lora.grouped_triton",
                                                        "set_grouped_prefill_fuse_slices", "grouped_prefill_fuse_slices"),
    "MOELORA_GROUPED_PREFILL_CONFIG": (
        lambda v: _import("moelora.kernels.moe_lora.grouped_triton").set_grouped_prefill_config(
            _import("moelora.kernels.moe_lora.grouped_triton").parse_grouped_config(v)),
        lambda: "x".join(str(getattr(_import("moelora.kernels.moe_lora.grouped_triton").grouped_prefill_config(), f))
                         for f in ("block_d", "block_n", "num_warps", "num_stages")),
        ("128x128x4x3", "128x128x8x3", "128x64x4x3")),
    "MOELORA_PREFILL_LORA_EPILOGUE": (
        lambda v: _import("moelora.kernels.moe_lora.grouped_triton").set_prefill_lora_epilogue(int(v)),
        lambda: str(_import("moelora.kernels.moe_lora.grouped_triton").prefill_lora_epilogue()), ("0", "1", "2", "3")),
    "MOELORA_FP8_PREFILL_CONFIG": (lambda v: _import("moelora.kernels.quant.fp8_triton").set_fp8_prefill_config(v),
                                   lambda: _import("moelora.kernels.quant.fp8_triton").fp8_prefill_config(),
                                   ("experts", "wide", "narrow")),
    "MOELORA_FUSED_ROUTER": _bool_switch("moelora.kernels.moe.router_triton", "set_fused_router", "fused_router"),
    "MOELORA_MOE_COMBINE_TO_NORM": _bool_switch("moelora.kernels.moe.experts_triton", "set_moe_combine_to_norm",
                                                "moe_combine_to_norm"),
    "MOELORA_ROUTER_CONFIG": (lambda v: _import("moelora.kernels.moe.router_triton").set_router_config(
                                  *(int(x) for x in v.split("x"))),
                              lambda: _import("moelora.kernels.moe.router_triton").router_config(),
                              _import("moelora.kernels.moe.router_triton").ROUTER_CONFIGS),
    "MOELORA_LORA_SHARED_A": _bool_switch(_T, "set_lora_shared_a", "lora_shared_a"),
    "MOELORA_FUSED_LORA_SLICE_FIRST": _bool_switch("moelora.kernels.moe_lora.fused_triton",
                                                   "set_fused_lora_slice_first", "fused_lora_slice_first"),
    "MOELORA_LORA_EVEN_R": _bool_switch(_T, "set_lora_even_r", "lora_even_r"),
    "MOELORA_FP8_LORA_PDL": _bool_switch("moelora.kernels.quant.fp8_triton", "set_fp8_lora_pdl", "fp8_lora_pdl_enabled"),
    "MOELORA_LORA_DELTA_DTYPE": _delta_dtype(),
    "MOELORA_FP8_LORA_SPLIT": _fp8_lora_split(),
}


def _one_of(values: tuple[str, ...]) -> str:
    return values[0] if len(values) == 1 else ", ".join(values[:-1]) + " or " + values[-1]


def parse_ab(spec: str) -> list[tuple[str, dict[str, str]]]:
    """'name:ENV=V,ENV=V;name2:ENV=V' -> [(name, {ENV: V})]; the names unique and not 'default', every ENV one of
    SWITCHES with one of the values it takes (else ValueError, before anything is built)."""
    out: list[tuple[str, dict[str, str]]] = []
    for part in (p.strip() for p in spec.split(";")):
        if not part:
            continue
        name, sep, body = part.partition(":")
        name = name.strip()
        if not sep or not name or name == "default" or name in (n for n, _ in out):
            raise ValueError(f"--ab variant {part!r}: write name:ENV=V[,ENV=V] with a unique name other than "
                             f"'default'")
        env: dict[str, str] = {}
        for item in (i.strip() for i in body.split(",")):
            key, eq, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not eq or key not in SWITCHES:
                raise ValueError(f"--ab variant {name!r}: {item!r} is not ENV=V with ENV one of {sorted(SWITCHES)}")
            if value not in SWITCHES[key][2]:
                raise ValueError(f"--ab variant {name!r}: {key} takes {_one_of(SWITCHES[key][2])}, not {value!r}")
            env[key] = value
        out.append((name, env))
    return out


def current(names) -> dict[str, str]:
    """The present value of each named switch, as its environment string."""
    return {n: SWITCHES[n][1]() for n in names}


def apply(env: dict[str, str]) -> None:
    """Set each switch (values as parse_ab checked them)."""
    for name, value in env.items():
        SWITCHES[name][0](value)


def format_ab(rows: list[dict]) -> str:
    """The A/B table of `bench decode --ab`: per variant and case (workload, batch, adapters, targets), the median
    tokens/s and step over its rounds, the kept share against the default's no-adapter median of that workload and
    batch, and the change against the default's median for the same case."""
    import statistics

    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if "variant" in r:
            key = (r["variant"], r.get("workload"), r["batch"], r["adapters"], r.get("lora_targets") or "all")
            groups.setdefault(key, []).append(r)

    def median(key, field):
        vals = [r[field] for r in groups.get(key, [])]
        return statistics.median(vals) if vals else None

    own_base = any(k[0] != "default" and k[3] == 0 for k in groups)  # bench decode --ab-base
    lines = ["A/B (medians over rounds; kept: against the default's no-adapter median; vs default: same case"
             + ("; own: against the variant's own no-adapter median" if own_base else "") + ")",
             f"{'variant':14s} {'workload':8s} {'batch':>5s} {'ad':>3s} {'targets':10s} {'runs':>4s} {'tok/s':>9s} "
             f"{'step ms':>8s} {'kept':>6s} {'vs default':>10s}" + (f" {'own':>6s}" if own_base else "")]
    for key in groups:
        variant, workload, batch, n, which = key
        tps, step = median(key, "tokens_per_s"), median(key, "step_ms")
        base = median(("default", workload, batch, 0, "all"), "tokens_per_s")
        same = median(("default", workload, batch, n, which), "tokens_per_s")
        kept = f"{tps / base:6.1%}" if base and n else "     -"
        vs = f"{tps / same - 1:+10.2%}" if same and variant != "default" else "         -"
        own = ""
        if own_base:
            mine = median((variant, workload, batch, 0, "all"), "tokens_per_s")
            own = f" {tps / mine:6.1%}" if mine and n else "      -"
        lines.append(f"{variant:14s} {workload or '-':8s} {batch:5d} {n:3d} {which:10s} {len(groups[key]):4d} "
                     f"{tps:9.1f} {step:8.2f} {kept} {vs}{own}")
    return "\n".join(lines)
