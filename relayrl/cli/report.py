"""``relayrl report RUN_DIR``: an HTML report (and PNGs) from a run's metrics and samples."""

from __future__ import annotations

import argparse

HELP = "write RUN_DIR/report/index.html with charts of rewards, staleness, weights, timings"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run directory holding metrics.jsonl / samples.jsonl")


def run(args: argparse.Namespace) -> int:
    from relayrl.report.build import build_report

    report = build_report(args.run_dir)
    for name, reason in report.skipped.items():
        print(f"skipped chart {name}: {reason}")
    print(f"report: {report.html_path}")
    return 0
