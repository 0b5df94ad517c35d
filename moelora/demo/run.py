"""`moelora demo`: the bundled model and all its adapters in ONE mixed batch, checked row by row.

    python -m moelora.demo.run [--device cpu] [--per-adapter 4] [--seed 0]

Every adapter (and the base model, no adapter) gets several fresh random inputs; all requests go
through a single `LLM.generate` call, so rows of different adapters share every forward pass. Each
row's output must equal its adapter's transform of the input (see `moelora.demo.TRANSFORMS`): a row
that picked up another adapter's weights prints visibly wrong text (upper case, reversed, ROT13).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

from moelora.demo import ADAPTERS, MAX_LEN, TRANSFORMS, adapter_paths, make_prompt, model_path, random_input
from moelora.engine.llm import LLM
from moelora.engine.sampling_params import SamplingParams
from moelora.kernels.config import KernelConfig

MAX_TOKENS = MAX_LEN + 8  # longest completion (24 characters + the newline EOS) with room to spare
_OUT_WIDTH = MAX_LEN + 2


def _show(text: str, width: int) -> str:
    """One table cell: control and non-ASCII characters escaped, cut to width."""
    s = text.encode("ascii", "backslashreplace").decode("ascii")
    s = "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)
    return s if len(s) <= width else s[: width - 3] + "..."


def run_demo(device: str | None = None, per_adapter: int = 4, seed: int | None = None,
             cpu_threads: int | None = None, kernel_config: KernelConfig | None = None) -> int:
    """Run one mixed batch over the bundled model and adapters and print a table.
    device: "cuda", "cpu", ... (None: a GPU when present, else the CPU) · per_adapter: rows per adapter
    (and for the base) · seed: the inputs' random seed (None: fresh inputs each run) · cpu_threads: torch's
    threads on the CPU (None: the engine's choice) · kernel_config: the kernels' choices (None: the defaults).
    Returns 0 when every row is right, 1 otherwise."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    paths = adapter_paths()
    missing = [p for p in [model_path(), *paths.values()] if not os.path.isdir(p)]
    if missing:
        print(f"moelora demo: bundled weights missing ({', '.join(missing)}); "
              "create them with: python scripts/train_demo.py", file=sys.stderr)
        return 1
    rng = random.Random(seed)
    rows = [(name, random_input(rng)) for name in [None, *ADAPTERS] for _ in range(per_adapter)]
    rng.shuffle(rows)  # adapters interleaved within the one batch

    t0 = time.perf_counter()
    llm = LLM(model=model_path(), adapters=paths, max_loras=8, max_lora_rank=64, dtype="float32", device=device,
              cpu_threads=cpu_threads, kernel_config=kernel_config)
    t_load = time.perf_counter() - t0
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    t0 = time.perf_counter()
    outs = llm.generate([make_prompt(text) for _, text in rows], params, adapter=[name for name, _ in rows])
    t_gen = time.perf_counter() - t0

    header = ("#", "adapter", "input", "output", "expected", "ok")
    widths = (len(str(len(rows))), max(len("(base)"), *map(len, ADAPTERS)), MAX_LEN, _OUT_WIDTH, MAX_LEN, 4)
    line = "  ".join(f"{h:<{w}}" for h, w in zip(header, widths)).rstrip()
    print(f"moelora demo: {len(rows)} requests ({per_adapter} per adapter, base included) in one mixed batch "
          f"on {device}\n")
    print(line)
    print("  ".join("-" * w for w in widths))
    wrong = 0
    for i, ((name, text), out) in enumerate(zip(rows, outs), 1):
        want = TRANSFORMS[name](text)
        ok = out.text == want and out.finish_reason == "stop"
        wrong += not ok
        cells = (str(i), name or "(base)", _show(text, MAX_LEN), _show(out.text, _OUT_WIDTH), want,
                 "ok" if ok else "FAIL")
        print("  ".join(f"{c:<{w}}" for c, w in zip(cells, widths)).rstrip())
    n_tok = sum(len(o.token_ids) for o in outs)
    print()
    print(f"generated {n_tok} tokens in {t_gen:.2f} s: {n_tok / max(t_gen, 1e-9):.1f} tokens/s "
          f"(model and {len(paths)} adapters loaded in {t_load:.2f} s)")
    if wrong:
        print(f"FAILED: {wrong} of {len(rows)} rows differ from the expected output")
        return 1
    print(f"all {len(rows)} rows correct")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moelora.demo.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cuda, cpu, ... (default: a GPU if present, else the CPU)")
    p.add_argument("--per-adapter", type=int, default=4, help="requests per adapter and for the base model")
    p.add_argument("--seed", type=int, default=None, help="seed of the random inputs (default: fresh each run)")
    p.add_argument("--cpu-threads", type=int, default=None, help="torch's threads on the CPU (default: the engine's)")
    args = p.parse_args(argv)
    return run_demo(args.device, args.per_adapter, args.seed, args.cpu_threads)


if __name__ == "__main__":
    sys.exit(main())
