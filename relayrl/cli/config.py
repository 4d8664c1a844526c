"""``relayrl config [--config FILE] [KEY=VALUE ...]``: print the resolved config, or the
reference of every key (``--reference``)."""

from __future__ import annotations

import argparse

from relayrl.cli.common import add_config_arguments, load_run_config

HELP = "print the resolved run config (or the reference of every key with --reference)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, config_required=False)
    parser.add_argument(
        "--reference",
        action="store_true",
        help="print the markdown reference of every key (docs/config.md)",
    )


def run(args: argparse.Namespace) -> int:
    if args.reference:
        from relayrl.config.reference import config_reference

        print(config_reference(), end="")
        return 0
    import yaml

    config = load_run_config(args)
    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
    return 0
