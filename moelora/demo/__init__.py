"""The bundled demo: a tiny Qwen3-MoE model that echoes its input, and three LoRA adapters that
transform it visibly (upper case, reversed, ROT13), so a mixed-adapter batch that leaks one
adapter's weights into another's rows shows it in plain text.

Task format (fixed): the prompt is ``make_prompt(text) = text + " => "``; the model completes it with
the transformed text followed by a newline, which is an EOS id of the model (generation stops there,
and the newline is not part of the output text). Inputs are lowercase ASCII words separated by single
spaces, 3 to 24 characters long (``random_input``).

The weights live in ``moelora/demo/assets/`` (written by ``scripts/train_demo.py``); see its MODEL_CARD.md.
"""

from __future__ import annotations

import codecs
import os
import random
import string

__all__ = ["TRANSFORMS", "ADAPTERS", "MIN_LEN", "MAX_LEN", "SEPARATOR", "assets_path", "model_path",
           "adapter_paths", "random_input", "make_prompt"]

MIN_LEN, MAX_LEN = 3, 24
SEPARATOR = " => "
ADAPTERS = ("upper", "reverse", "rot13")
_LETTERS = string.ascii_lowercase
_SPACE_PROB = 0.18  # chance of a word break after a letter: words of ~5.5 letters on average

# adapter name (None = the base model, no adapter) -> what the model should output
TRANSFORMS = {None: lambda text: text, "upper": str.upper, "reverse": lambda text: text[::-1],
              "rot13": lambda text: codecs.encode(text, "rot13")}


def random_input(rng: random.Random) -> str:
    """Lowercase ASCII words separated by single spaces, MIN_LEN..MAX_LEN characters in all
    (uniform length; no leading, trailing or double spaces)."""
    n = rng.randint(MIN_LEN, MAX_LEN)
    chars = [rng.choice(_LETTERS)]
    for i in range(1, n):
        if chars[-1] != " " and i < n - 1 and rng.random() < _SPACE_PROB:
            chars.append(" ")
        else:
            chars.append(rng.choice(_LETTERS))
    return "".join(chars)


def make_prompt(text: str) -> str:
    return text + SEPARATOR


def assets_path() -> str:
    """The folder of the bundled weights (inside the installed package)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")


def model_path() -> str:
    """The bundled base model folder (transformers format: config.json, model.safetensors, tokenizer)."""
    return os.path.join(assets_path(), "model")


def adapter_paths() -> dict[str, str]:
    """Adapter name -> its PEFT folder, for every bundled adapter."""
    return {name: os.path.join(assets_path(), name) for name in ADAPTERS}
