"""``relayrl bench <name>``: benchmarks; each lives in ``relayrl.bench.<module>``, exposing
``HELP``, ``add_arguments(parser)`` and ``run(args) -> int`` like the CLI commands.
"""

from __future__ import annotations

import argparse

from relayrl.cli.common import add_module_subcommands, run_module_subcommand

HELP = "run a benchmark (engine, async, trl, demo, publish, ...)"

# benchmark name -> module under relayrl.bench
BENCHMARKS: dict[str, str] = {
    "engine": "engine",
    "async": "async_rl",
    "trl": "trl",
    "trl-gradient": "trl_gradient",
    "http": "http",
    "trainer": "trainer",
    "demo": "demo",
    "publish": "publish",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_module_subcommands(parser, "relayrl.bench", BENCHMARKS, "benchmark")


def run(args: argparse.Namespace) -> int:
    return run_module_subcommand(args)
