"""Command-line entry point: ``relayrl <command> ...``.

Each command lives in its own module here exposing ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int``. Modules import heavy dependencies (torch, transformers) inside ``run``
so that ``relayrl --help`` and argument errors stay instant.

Imports: any relayrl package (the top layer; ``relayrl bench`` and ``relayrl experiment``
load their modules by name); no relayrl package imports it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from relayrl.cli.intermixed import IntermixedParser
from relayrl.errors import RelayError

PLUGIN_HELP = (
    "import user code that registers tasks, graders, losses, advantages or workflows before "
    "anything is validated: a module name or a .py path (repeatable; docs/your-own.md)"
)

# command name -> module under relayrl.cli
COMMANDS: dict[str, str] = {
    "demo": "demo",
    "sft": "sft",
    "config": "config",
    "serve": "serve",
    "bench": "bench",
    "grade": "grade",
    "eval": "eval",
    "report": "report",
    "check": "check",
    "inspect": "inspect",
    "train": "train",
    "experiment": "experiment",
}


def build_parser() -> argparse.ArgumentParser:
    parser = IntermixedParser(
        prog="relayrl", description="Fully asynchronous RL for LLM reasoning."
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for user errors")
    parser.add_argument(
        "--plugin", action="append", default=[], metavar="MODULE_OR_PATH", help=PLUGIN_HELP
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"relayrl.cli.{module_name}")
        cmd = sub.add_parser(name, help=module.HELP, description=module.HELP)
        cmd.add_argument(
            "--debug",
            action="store_true",
            default=argparse.SUPPRESS,
            help="show full tracebacks for user errors",
        )
        cmd.add_argument(
            "--plugin",
            dest="command_plugin",
            action="append",
            default=[],
            metavar="MODULE_OR_PATH",
            help=PLUGIN_HELP,
        )
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    from relayrl.heap import bound_kernel_caches
    from relayrl.models.loading import quiet_libraries

    quiet_libraries()  # relayrl prints its own progress: no library bars in any command
    bound_kernel_caches()  # before any bf16 product; the processes a command starts inherit it
    args = build_parser().parse_args(argv)
    try:
        from relayrl.plugins import load_plugins, load_plugins_from_env

        load_plugins_from_env()
        plugins = [*args.plugin, *args.command_plugin]
        # --check / relayrl check: imported by the preflight, which reports a failure
        args.plugin = plugins if getattr(args, "check", False) else load_plugins(plugins)
        return int(args._run(args) or 0)
    except RelayError as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
