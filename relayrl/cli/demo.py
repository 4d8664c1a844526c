"""``relayrl demo``: the main job on the embedded default config (no file needed).

Today the main job is the SFT warm start and its evaluation; it becomes the asynchronous RL
run once `relayrl train` lands.
"""

from __future__ import annotations

import argparse

from relayrl.cli import sft
from relayrl.cli.common import add_config_arguments

HELP = "run the main job on the embedded default config (what `make demo` runs)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, config_required=False)


def run(args: argparse.Namespace) -> int:
    return sft.run(args)
