"""Experiments: grids of real training runs that write a results page (docs/results/).

Each experiment lives in its own module exposing ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int``, like the CLI commands (``relayrl experiment <name>``).

Imports: the config loader, the RL job (``relayrl.train``), SFT, matplotlib (lazily).
"""
