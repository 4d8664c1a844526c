"""``relayrl check CONFIG [KEY=VALUE ...]``: the preflight of a run (``relayrl.train.preflight``).

Checks, in seconds and without training, everything a ``relayrl train`` of the same
arguments needs: plugins, config, backend environment, run directory, dataset, sandbox,
grader, model, chat template, one real server and generation (engine-vs-trainer KL), one
timed optimizer step, memory. One line per check (``ok   NAME: detail``, ``error: NAME:
what is wrong — the fix``, ``skip NAME: ...`` after a failed prerequisite); the exit
status is 1 when any check failed. ``relayrl train --check`` runs the same then exits.
The plugins are imported by the ``plugins`` check, not before the command (``args.check``).
"""

from __future__ import annotations

import argparse

from relayrl.cli.common import add_config_arguments

HELP = "check a run's config, data, grader, model, server and machine in seconds, without training"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.set_defaults(check=True)


def run_preflight(args: argparse.Namespace, load) -> int:
    """The preflight of ``load(plugins) -> RunConfig``; 0 when every check passed."""
    from relayrl.train.preflight import preflight

    report = preflight(load, args.config, list(args.plugin or []), bool(args.debug))
    failed = [o.name for o in report.outcomes if o.status == "error"]
    print(f"check: {'failed: ' + ', '.join(failed) if failed else 'all passed'}")
    return 1 if failed else 0


def run(args: argparse.Namespace) -> int:
    from relayrl.config.loader import load_config

    return run_preflight(
        args, lambda plugins: load_config(args.config, args.overrides, plugins=plugins)
    )
