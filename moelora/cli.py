"""Command line: `moelora <command> --help` explains each command."""

from __future__ import annotations

import argparse
import sys


def _cmd_check_adapter(args: argparse.Namespace) -> int:
    from moelora.adapters.errors import AdapterError
    from moelora.adapters.registry import load_adapter
    from moelora.config import ModelConfig
    from moelora.models.loader import build_model

    cfg = ModelConfig.from_pretrained(args.model)
    # the adapter is validated against the model's shapes; weights are not needed for that
    model = build_model(cfg, None, dtype="float32", device="meta", load_format="none",
                        max_loras=1, max_lora_rank=args.max_lora_rank)
    status = 0
    for spec in args.adapters:
        name, _, path = spec.rpartition("=") if "=" in spec else (spec, "", spec)
        try:
            adapter = load_adapter(name, path, model.lora_targets(), args.max_lora_rank)
        except AdapterError as e:
            print(f"REJECTED {e}")
            status = 1
            continue
        kinds: dict[str, list[int]] = {}
        for target, mod in adapter.modules.items():
            kinds.setdefault(target.split(".", 3)[-1], []).append(mod.rank)
        print(f"OK {name!r}: {len(adapter.modules)} target weights, max rank {adapter.max_rank}")
        for kind, ranks in sorted(kinds.items()):
            print(f"   {kind:32s} layers={len(ranks):3d} rank={sorted(set(ranks))}")
    return status


def _cmd_info(args: argparse.Namespace) -> int:
    from moelora.config import ModelConfig

    cfg = ModelConfig.from_pretrained(args.model)
    for k, v in cfg.__dict__.items():
        if k != "hf_config":
            print(f"{k:32s} {v}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moelora",
        description="Serve one Mixture-of-Experts LLM with many LoRA adapters at once (Qwen3-MoE, Qwen2-MoE, "
        "Mixtral, OLMoE). Each request names its adapter; one batch mixes adapters freely.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="command")

    info = sub.add_parser("info", help="print the model configuration moelora reads from a model folder")
    info.add_argument("model", help="model folder with config.json")
    info.set_defaults(func=_cmd_info)

    chk = sub.add_parser(
        "check-adapter",
        help="validate PEFT LoRA adapters against a base model without loading its weights",
        description="Reads each adapter (any of the three expert layouts), checks every tensor against the base "
        "model's shapes and prints what it targets, or why it is rejected. Exit status 1 if any is rejected.",
    )
    chk.add_argument("--model", required=True, help="base model folder with config.json")
    chk.add_argument("--max-lora-rank", type=int, default=64, help="largest rank the server will accept (default 64)")
    chk.add_argument("adapters", nargs="+", metavar="NAME=PATH", help="adapter folders (NAME= optional)")
    chk.set_defaults(func=_cmd_check_adapter)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
