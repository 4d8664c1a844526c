"""``relayrl experiment <name>``: experiments that run grids of training runs and write a
results page; each lives in ``relayrl.experiments.<module>`` (``HELP``,
``add_arguments(parser)``, ``run(args) -> int``).
"""

from __future__ import annotations

import argparse
import importlib

HELP = "run an experiment grid and write its results page (staleness, ...)"

# experiment name -> module under relayrl.experiments
EXPERIMENTS: dict[str, str] = {"staleness": "staleness"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="experiment", metavar="EXPERIMENT", required=True)
    for name, module_name in EXPERIMENTS.items():
        module = importlib.import_module(f"relayrl.experiments.{module_name}")
        cmd = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(cmd)
        cmd.set_defaults(_experiment_run=module.run)


def run(args: argparse.Namespace) -> int:
    return int(args._experiment_run(args) or 0)
