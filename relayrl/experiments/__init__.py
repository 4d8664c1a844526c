"""Experiments: grids of real training runs that write a results page (docs/results/).

Each experiment lives in its own module exposing ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int``, like the CLI commands (``relayrl experiment <name>``, which loads it by
name).

Imports: relayrl.train (the RL job, SFT), relayrl.config (the loader, ``RunBudget``),
relayrl.rollout.eta, relayrl.report.logs, relayrl.models, relayrl.metric_names,
relayrl.errors, matplotlib (lazily); never relayrl.bench (its independent sibling) or
relayrl.cli.
"""
