"""Switches read from the environment at import: an empty value means the default, a value that is not one of the
choices is an error naming the variable (not a silent default, not a bare int() error). Subprocesses: the values
are read when the module is first imported."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = ("import moelora.kernels.quant.fp8_triton as f, moelora.kernels.lora.delta_triton as d, "
         "moelora.kernels._triton as t; "
         "print(f._PREQUANT_MIN_ROWS[0], f._LORA_SPLIT[0], f._LORA_SPLIT[1], t.moe_lora_early_mode(), "
         "f.fp8_prefill_config(), d.lora_delta_warps())")


def _import_with(env: dict[str, str]) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("MOELORA_")}
    return subprocess.run([sys.executable, "-c", PROBE], env={**full, **env}, capture_output=True, text=True,
                          timeout=120)


def test_the_defaults_and_empty_values_are_the_same():
    names = ("MOELORA_FP8_PREQUANT_MIN_ROWS", "MOELORA_FP8_LORA_SPLIT", "MOELORA_FP8_LORA_SPLIT_MAX_ROWS",
             "MOELORA_MOE_LORA_EARLY", "MOELORA_FP8_PREFILL_CONFIG", "MOELORA_LORA_DELTA_WARPS")
    unset, empty = _import_with({}), _import_with({n: "" for n in names})
    assert unset.returncode == 0 and empty.returncode == 0, unset.stderr + empty.stderr
    assert unset.stdout == empty.stdout
    assert unset.stdout.split() == ["1", "4", "64", "2", "experts", "0"], unset.stdout


@pytest.mark.parametrize("name, value, want", [
    ("MOELORA_FP8_PREQUANT_MIN_ROWS", "many", "MOELORA_FP8_PREQUANT_MIN_ROWS must be an integer, got 'many'"),
    ("MOELORA_FP8_LORA_SPLIT_MAX_ROWS", "6x4", "MOELORA_FP8_LORA_SPLIT_MAX_ROWS must be an integer"),
    ("MOELORA_MOE_LORA_EARLY", "3", "MOELORA_MOE_LORA_EARLY must be one of"),
    ("MOELORA_FP8_PREFILL_CONFIG", "huge", "MOELORA_FP8_PREFILL_CONFIG must be one of"),
    ("MOELORA_LORA_DELTA_WARPS", "3", "MOELORA_LORA_DELTA_WARPS must be 0 (the default), 1, 2, 4 or 8"),
])
def test_a_bad_value_is_an_error_naming_the_variable(name, value, want):
    r = _import_with({name: value})
    assert r.returncode != 0 and want in r.stderr, r.stderr[-2000:]
