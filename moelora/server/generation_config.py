"""Sampling defaults from a model folder's generation_config.json, for the fields a request leaves out (as vLLM's
`--generation-config auto`)."""

from __future__ import annotations

import json
import logging
import os

log = logging.getLogger("moelora.server")

# generation_config.json key -> request field (vLLM reads the same keys; do_sample is not one of them)
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(setting: str, model_path: str) -> dict[str, float | int]:
    """setting "auto": the model folder's generation_config.json; "vllm": none (the built-in defaults); else a
    folder holding a generation_config.json. Returns {request field: value} for the keys in KEYS that the file
    sets; raises ValueError for a folder without the file or a file that is not a JSON object."""
    if setting == "vllm":
        return {}
    folder = model_path if setting == "auto" else setting
    file = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(file):
        if setting == "auto":
            return {}
        raise ValueError(f"--generation-config {setting!r}: no generation_config.json in that folder")
    try:
        with open(file) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file} must hold a JSON object")
    out: dict[str, float | int] = {}
    for key, field in KEYS.items():
        value = raw.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[field] = value
    if out:
        log.info("sampling defaults from %s for fields a request leaves out: %s", file, out)
    return out
