"""The command line prints the errors a user can act on (bad model folder, bad adapter, missing GPU) as one line
naming the command, with exit status 1, and no traceback; anything else still raises with its traceback."""

from __future__ import annotations

import pytest
import torch

from moelora.cli import main


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [l for l in err.splitlines() if l.startswith("moelora ")]
    assert len(lines) == 1, err
    return lines[0]


def test_a_missing_model_folder_is_one_line(tmp_path, capsys):
    assert main(["info", str(tmp_path / "nowhere")]) == 1
    line = _error_line(capsys)
    assert line.startswith("moelora info: error: no config.json at ")
    assert "pass a model folder that holds config.json" in line


def test_a_missing_adapter_folder_names_the_adapter(tmp_path, capsys):
    rc = main(["generate", "--device", "cpu", "--lora", f"mine={tmp_path / 'nowhere'}", "--adapter", "mine",
               "--prompt", "hi", "--max-tokens", "1"])
    assert rc == 1
    line = _error_line(capsys)
    assert line.startswith("moelora generate: error: adapter 'mine': adapter folder ")
    assert "does not exist" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_asking_for_a_gpu_without_one_says_what_to_do(capsys):
    assert main(["generate", "--device", "cuda", "--prompt", "hi", "--max-tokens", "1"]) == 1
    line = _error_line(capsys)
    assert line.startswith("moelora generate: error: device='cuda' requested but torch sees no GPU")
    assert "--device cpu" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_nvfp4_without_a_gpu_says_what_to_do(capsys):
    assert main(["generate", "--device", "cpu", "--quantization", "nvfp4", "--prompt", "hi",
                 "--max-tokens", "1"]) == 1
    line = _error_line(capsys)
    assert line.startswith("moelora generate: error: NVFP4 needs a CUDA GPU")
    assert "leave out --quantization nvfp4" in line


def test_an_unexpected_error_keeps_its_traceback(monkeypatch):
    import moelora.cli as cli

    def boom(args):
        raise KeyError("a bug, not a user error")

    parser = cli.build_parser()
    real_parse = parser.parse_args

    def parse(argv=None):
        args = real_parse(argv)
        args.func = boom
        return args

    monkeypatch.setattr(parser, "parse_args", parse)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    with pytest.raises(KeyError, match="a bug"):
        cli.main(["info", "anything"])


# ---- every invalid value is one line naming the flag and its accepted range (exit status 2), before any work ------

def one_error_line(capsys, argv: list[str]) -> str:
    """The one line `moelora ARGV` prints for a bad command line (exit status 2, no traceback, no usage block)."""
    from moelora.cli import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "usage:" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("argv, flag, accepted", [
    (["serve", "--max-loras", "0"], "--max-loras", ">= 1"),
    (["serve", "--max-lora-rank", "0"], "--max-lora-rank", ">= 1"),
    (["serve", "--max-cpu-loras", "0"], "--max-cpu-loras", ">= 1"),
    (["serve", "--port", "70000"], "--port", "[1, 65535]"),
    (["serve", "--port", "http"], "--port", "[1, 65535]"),
    (["serve", "--max-num-seqs", "0"], "--max-num-seqs", ">= 1"),
    (["serve", "--max-num-batched-tokens", "-1"], "--max-num-batched-tokens", ">= 1"),
    (["serve", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization", "(0, 1]"),
    (["serve", "--gpu-memory-utilization", "0"], "--gpu-memory-utilization", "(0, 1]"),
    (["serve", "--block-size", "0"], "--block-size", ">= 1"),
    (["serve", "--max-model-len", "-1"], "--max-model-len", "positive"),
    (["serve", "--max-body-bytes", "0"], "--max-body-bytes", ">= 1"),
    (["serve", "--max-n", "0"], "--max-n", ">= 1"),
    (["serve", "--kv-cache-memory", "0"], "--kv-cache-memory", ">= 1"),
    (["serve", "--max-graph-batch-size", "0"], "--max-graph-batch-size", ">= 1"),
    (["serve", "--tp", "0"], "--tp", ">= 1"),
    (["serve", "--ep", "0"], "--ep", ">= 1"),
    (["serve", "--dtype", "int8"], "--dtype", "bfloat16"),
    (["generate", "--prompt", "hi", "--max-tokens", "0"], "--max-tokens", ">= 1"),
    (["generate", "--prompt", "hi", "--temperature", "-1"], "--temperature", ">= 0"),
    (["generate", "--prompt", "hi", "--top-p", "0"], "--top-p", "(0, 1]"),
    (["generate", "--prompt", "hi", "--top-p", "1.5"], "--top-p", "(0, 1]"),
    (["generate", "--prompt", "hi", "--top-k", "-2"], "--top-k", ">= -1"),
    (["generate", "--prompt", "hi", "--max-lora-rank", "0"], "--max-lora-rank", ">= 1"),
    (["generate", "--prompt", "hi", "--lora", "no-equals-sign"], "--lora", "NAME=PATH"),
    (["demo", "--per-adapter", "0"], "--per-adapter", ">= 1"),
    (["check-adapter", "--model", "m", "--max-lora-rank", "0", "a=b"], "--max-lora-rank", ">= 1"),
])
def test_an_invalid_value_is_one_line_naming_the_flag_and_range(capsys, argv, flag, accepted):
    line = one_error_line(capsys, argv)
    assert line.startswith(f"moelora {argv[0]}: error: argument {flag}"), line
    assert accepted in line, line


def test_max_cpu_loras_below_max_loras_is_refused_as_vllm_does(capsys):
    line = one_error_line(capsys, ["serve", "--max-loras", "4", "--max-cpu-loras", "2"])
    assert line.startswith("moelora serve: error: --max-cpu-loras (2) must be >= --max-loras (4)")


def _no_model_load(monkeypatch):
    import moelora

    def load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(moelora, "LLM", load)


def test_a_sampling_params_error_in_generate_is_one_line_before_the_model_loads(monkeypatch, capsys):
    _no_model_load(monkeypatch)
    assert main(["generate", "--device", "cpu", "--prompt", "hi", "--stop", ""]) == 2
    line = _error_line(capsys)
    assert line.startswith("moelora generate: error: SamplingParams: stop must be non-empty strings")


def test_an_unknown_adapter_in_generate_is_one_line(monkeypatch, capsys):
    _no_model_load(monkeypatch)
    assert main(["generate", "--device", "cpu", "--prompt", "hi", "--adapter", "nope"]) == 2
    line = _error_line(capsys)
    assert line.startswith("moelora generate: error: --adapter 'nope' is not among the --lora names")


def test_one_adapter_name_given_two_paths_is_one_line(monkeypatch, capsys, tmp_path):
    _no_model_load(monkeypatch)
    rc = main(["generate", "--device", "cpu", "--prompt", "hi", "--lora", f"a={tmp_path / 'x'}",
               "--lora", f"a={tmp_path / 'y'}"])
    assert rc == 2
    assert _error_line(capsys).startswith("moelora generate: error: adapter 'a' given twice")
    line = one_error_line(capsys, ["serve", "--lora", f"a={tmp_path / 'x'}", "--lora-modules", f"a={tmp_path / 'y'}"])
    assert line.startswith("moelora serve: error: adapter 'a' given twice")


def test_an_unrecognized_flag_is_one_line(capsys):
    line = one_error_line(capsys, ["serve", "--no-such-flag"])
    assert line.startswith("moelora: error: unrecognized arguments: --no-such-flag")


@pytest.mark.parametrize("command", [["serve"], ["generate", "--prompt", "hi"], ["demo"], ["bench", "decode"],
                                     ["bench", "report"]])
@pytest.mark.parametrize("value, message", [
    ('{"nope": true}', "kernel config: unknown field 'nope'"),
    ('{"moe_lora": {"early": "yes"}}', "kernel config moe_lora.early: expected bool, got 'yes'"),
    ('{"side_stream_priority": "urgent"}', "side_stream_priority: 'high' or 'normal', got 'urgent'"),
    ("not json", "--kernel-config is not valid JSON"),
])
def test_a_bad_kernel_config_is_one_line_naming_the_field(capsys, command, value, message):
    line = one_error_line(capsys, [*command, "--kernel-config", value])
    assert line.startswith(f"moelora {' '.join(command[:2] if command[0] == 'bench' else command[:1])}: error: "
                           "argument --kernel-config: "), line
    assert message in line, line


def test_help_explains_kernel_config_and_names_the_page(capsys):
    from moelora.cli import build_parser

    for command in (["serve"], ["generate"], ["demo"], ["bench", "decode"], ["bench", "report"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*command, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert "--kernel-config JSON" in out and "docs/configuration.md" in out, command


@pytest.mark.parametrize("argv, message", [
    (["--ab", "x:nope=1"], "--ab variant 'x': kernel config: no field 'nope'"),
    (["--ab", "x:moe_lora.early=2"], "--ab variant 'x': kernel config moe_lora.early: expected 0/1 or true/false"),
    (["--ab", "default:moe_lora.early=0"], "write name:key=value[,key=value] with a unique name"),
    (["--ab", "x:moe_lora.early=0", "--tp", "2"], "--ab compares kernel configs in one process"),
    (["--ab-rounds", "0"], "--ab-rounds must be at least 1"),
    (["--repeat", "0"], "--repeat must be at least 1"),
])
def test_bench_decode_refuses_a_bad_ab_in_one_line_before_anything_is_built(capsys, argv, message):
    line = one_error_line(capsys, ["bench", "decode", *argv])
    assert line.startswith("moelora bench decode: error: ") and message in line, line
