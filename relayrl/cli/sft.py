"""``relayrl sft CONFIG [KEY=VALUE ...]``: build the small model, SFT warm start, evaluate."""

from __future__ import annotations

import argparse

from relayrl.cli.common import add_config_arguments, add_overwrite_argument, load_run_config

HELP = "build the model, SFT it on task demonstrations, print base_pass@1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_overwrite_argument(parser)


def run(args: argparse.Namespace) -> int:
    config = load_run_config(args)
    from relayrl.train.sft import run_sft

    pass_at_1 = run_sft(config, overwrite=args.overwrite)
    print(f"run directory: {config.output_dir}/{config.name}")
    print(f"base_pass@1={pass_at_1:.2f}")
    return 0
