"""``relayrl bench <name>``: benchmarks; each lives in ``relayrl.bench.<module>``, exposing
``HELP``, ``add_arguments(parser)`` and ``run(args) -> int`` like the CLI commands.
"""

from __future__ import annotations

import argparse
import importlib

HELP = "run a benchmark (engine, ...)"

# benchmark name -> module under relayrl.bench
BENCHMARKS: dict[str, str] = {"engine": "engine", "async": "async_rl"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(f"relayrl.bench.{module_name}")
        cmd = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(cmd)
        cmd.set_defaults(_bench_run=module.run)


def run(args: argparse.Namespace) -> int:
    return int(args._bench_run(args) or 0)
