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
