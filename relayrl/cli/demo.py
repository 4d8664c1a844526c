"""``relayrl demo``: the main job on the embedded default config (what ``make demo`` runs).

SFT warm start of the default model on the default task, then asynchronous RL from it
(``relayrl train`` with the embedded defaults: η = 4, decoupled PPO), a run report, and as
the last line ``final_pass@1=0.xx``. Overrides (``KEY=VALUE``) and a config file work as for
``relayrl train``.
"""

from __future__ import annotations

import argparse

from relayrl.cli import train
from relayrl.cli.common import add_config_arguments, add_overwrite_argument, load_run_config

HELP = "SFT warm start + asynchronous RL on the default config (what `make demo` runs)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, config_required=False)
    add_overwrite_argument(parser)


def run(args: argparse.Namespace) -> int:
    config = load_run_config(args)
    train.interrupt_on_sigterm()
    from relayrl.report.build import build_report
    from relayrl.train.run import run_train

    result = run_train(config, overwrite=args.overwrite)
    report = build_report(result.run_dir)
    print(f"run directory: {result.run_dir}")
    print(f"report: {report.html_path}")
    train.print_result_lines(result)
    return 0
