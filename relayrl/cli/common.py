"""Arguments shared by commands that take a run config."""

from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser, config_required: bool = True) -> None:
    if config_required:
        parser.add_argument("config", help="YAML run config (see configs/)")
    else:
        parser.add_argument(
            "--config", default=None, help="YAML run config (default: the embedded defaults)"
        )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides, e.g. sft.lr=1e-3 task.params.max_steps=6",
    )


def load_run_config(args: argparse.Namespace):
    from relayrl.config.loader import load_config

    return load_config(args.config, args.overrides)
