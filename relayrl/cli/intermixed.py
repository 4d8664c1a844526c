"""Options anywhere on the command line: ``relayrl train CONFIG --plugin P KEY=V``.

Owns: :class:`IntermixedParser`, the ``ArgumentParser`` of every ``relayrl`` (sub)command.
A command whose positionals are a config and ``KEY=VALUE`` overrides parses them with
argparse's ``parse_known_intermixed_args``: options first, with the positionals set aside,
then the positionals, so an option between two of them no longer ends the list (plain
argparse took ``KEY=V`` after ``--plugin P`` for an unrecognised argument). A parser with
subcommands (``relayrl``, ``relayrl bench``) parses as usual and hands the rest to the
subcommand's parser, an :class:`IntermixedParser` too (argparse makes subparsers of their
parent's class).

Imports: the standard library.
"""

from __future__ import annotations

import argparse
from typing import Any


class IntermixedParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose leaf commands take options between positionals."""

    _intermixing = False

    def parse_known_args(self, args: Any = None, namespace: Any = None):  # type: ignore[override]
        if self._intermixing or self._subparsers is not None:
            return super().parse_known_args(args, namespace)
        self._intermixing = True  # parse_known_intermixed_args calls back in (Python < 3.12)
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False
