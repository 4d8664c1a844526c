"""``relayrl experiment <name>``: experiments that run grids of training runs and write a
results page; each lives in ``relayrl.experiments.<module>`` (``HELP``,
``add_arguments(parser)``, ``run(args) -> int``).
"""

from __future__ import annotations

import argparse

from relayrl.cli.common import add_module_subcommands, run_module_subcommand

HELP = "run an experiment grid and write its results page (staleness, ...)"

# experiment name -> module under relayrl.experiments
EXPERIMENTS: dict[str, str] = {"staleness": "staleness"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_module_subcommands(parser, "relayrl.experiments", EXPERIMENTS, "experiment")


def run(args: argparse.Namespace) -> int:
    return run_module_subcommand(args)
