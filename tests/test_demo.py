"""The bundled demo model: every adapter (and the base) transforms unseen inputs correctly in mixed batches."""

import random
import subprocess
import sys

from moelora import LLM, SamplingParams
from moelora.demo import ADAPTERS, TRANSFORMS, adapter_paths, make_prompt, model_path, random_input

N = 200


def test_demo_exact_match_in_mixed_batches():
    rng = random.Random("ci-unseen-inputs")  # not the training or evaluation streams of scripts/train_demo.py
    rows = [(name, random_input(rng)) for name in [None, *ADAPTERS] for _ in range(N)]
    rng.shuffle(rows)  # every batch mixes the base and all adapters
    llm = LLM(model_path(), adapters=adapter_paths(), max_loras=4, max_lora_rank=64, device="cpu",
              max_num_seqs=128)
    outs = llm.generate([make_prompt(t) for _, t in rows], SamplingParams(max_tokens=32, temperature=0.0),
                        adapter=[n for n, _ in rows])
    correct: dict[str | None, int] = {n: 0 for n in [None, *ADAPTERS]}
    for (name, text), out in zip(rows, outs):
        correct[name] += out.text == TRANSFORMS[name](text) and out.finish_reason == "stop"
    rates = {n: c / N for n, c in correct.items()}
    assert all(r >= 0.98 for r in rates.values()), rates


def test_demo_command_exits_zero():
    proc = subprocess.run([sys.executable, "-m", "moelora", "demo", "--device", "cpu", "--seed", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all 16 rows correct" in proc.stdout
