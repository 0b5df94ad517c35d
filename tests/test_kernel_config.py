"""The kernel config's strict parsing (KernelConfig.from_json / from_dict / with_overrides: an unknown field or a
value of the wrong type is an error naming it, as `--kernel-config` and `bench decode --ab` report it), and the
environment: the package reads at most 15 MOELORA_* names, all operational."""

from __future__ import annotations

import pytest

from moelora.kernels.config import KernelConfig, field_names
from test_docs_configuration import source_names

MAX_ENV_NAMES = 15


def test_the_defaults_round_trip():
    cfg = KernelConfig()
    assert KernelConfig.from_json(None) == KernelConfig.from_json("") == KernelConfig.from_json("{}") == cfg
    assert KernelConfig.from_dict(cfg.to_dict()) == cfg and cfg.diff() == {}
    assert "moe_lora.early" in field_names() and "side_stream_priority" in field_names()
    assert all(n.count(".") <= 1 for n in field_names())


def test_from_json_sets_fields_by_section():
    cfg = KernelConfig.from_json('{"moe_lora": {"early": false}, "side_stream_priority": "normal"}')
    assert cfg.moe_lora.early is False and cfg.side_stream_priority == "normal"
    assert cfg.diff() == {"moe_lora.early": False, "side_stream_priority": "normal"}
    section = next(n for n in field_names() if "." in n)
    head, tail = section.split(".")
    default = getattr(getattr(KernelConfig(), head), tail)
    value = (not default) if isinstance(default, bool) else default
    assert KernelConfig.from_dict({head: {tail: value}}).diff() == ({section: value} if value != default else {})


@pytest.mark.parametrize("text, message", [
    ('{"nope": 1}', "kernel config: unknown field 'nope'"),
    ('{"moe": {"nope": 1}}', "kernel config: unknown field 'moe.nope'"),
    ('{"moe_lora": {"early": 1}}', "kernel config moe_lora.early: expected bool, got 1"),
    ('{"side_stream_priority": true}', "kernel config side_stream_priority: expected str, got True"),
    ('{"side_stream_priority": "urgent"}', "side_stream_priority: 'high' or 'normal', got 'urgent'"),
    ('{"moe": 1}', "kernel config moe: expected an object, got 1"),
    ("[1]", "--kernel-config must be a JSON object"),
    ("{early: true}", "--kernel-config is not valid JSON"),
])
def test_from_json_is_strict(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        KernelConfig.from_json(text)


def test_with_overrides_parses_each_value_as_its_fields_type():
    base = KernelConfig(side_stream_priority="normal")
    cfg = base.with_overrides({"moe_lora.early": "0", "side_stream_priority": "high"})
    assert cfg == KernelConfig.from_dict({"moe_lora": {"early": False}}) and base.side_stream_priority == "normal"  # frozen: a copy
    assert base.with_overrides({"moe_lora.early": "off"}).moe_lora.early is False
    for key, raw, message in [("nope", "1", "no field 'nope'"), ("moe.nope", "1", "no field 'moe.nope'"),
                              ("nosection.x", "1", "no section 'nosection'"), ("moe", "1", "no field 'moe'"),
                              ("moe_lora.early", "yes", "expected 0/1 or true/false, got 'yes'"),
                              ("side_stream_priority", "urgent", "'high' or 'normal', got 'urgent'")]:
        with pytest.raises(ValueError, match=message):
            base.with_overrides({key: raw})
    ints = [n for n in field_names() if isinstance(_value(KernelConfig(), n), int)
            and not isinstance(_value(KernelConfig(), n), bool)]
    for name in ints:
        with pytest.raises(ValueError, match=f"kernel config {name}: expected an integer, got 'many'"):
            base.with_overrides({name: "many"})


def _value(cfg: KernelConfig, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_the_package_reads_at_most_15_environment_variables():
    names = source_names()
    assert len(names) <= MAX_ENV_NAMES, (
        f"{len(names)} MOELORA_* names in the sources (at most {MAX_ENV_NAMES}; a kernel choice belongs in "
        f"KernelConfig): {sorted(names)}")


def test_moving_a_layer_keeps_its_kernel_config():
    """Layers choose their kernels when configured and again when they move (module.to ends in _apply: the choice
    depends on the device), from the config they were given, not the defaults: a model built in host memory and
    moved to the GPU afterwards (a sharded checkpoint load) keeps --kernel-config."""
    import torch

    from moelora.kernels.config import KernelConfig
    from moelora.layers.moe import RoutedExperts

    cfg = KernelConfig.from_dict({"moe_lora": {"grouped_min_pairs": 512, "early": False}})
    m = RoutedExperts(4, 8, 6, "silu", torch.float32, "cpu")
    m.configure(cfg, triton=True)
    m.to(torch.float64)
    assert m.kernel_config is cfg and m.kernels.triton and not m.kernels.early
    assert m.kernels.lora.grouped_min_pairs == 512
