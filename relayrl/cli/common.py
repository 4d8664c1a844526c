"""Arguments shared by commands that take a run config."""

from __future__ import annotations

import argparse
import importlib


def add_config_arguments(parser: argparse.ArgumentParser, config_required: bool = True) -> None:
    if config_required:
        parser.add_argument("config", help="YAML run config (see configs/)")
    else:
        parser.add_argument(
            "--config", default=None, help="YAML run config (default: the embedded defaults)"
        )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides, e.g. sft.lr=1e-3 task.params.max_steps=6",
    )


def add_overwrite_argument(parser: argparse.ArgumentParser) -> None:
    """``--overwrite``: a run directory that already holds a run is an error without it."""
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier run of the same name (<output_dir>/<name>); without it "
        "that is an error and the earlier run is left untouched",
    )


def load_run_config(args: argparse.Namespace):
    from relayrl.config.loader import load_config

    return load_config(args.config, args.overrides, plugins=getattr(args, "plugin", None))


def add_module_subcommands(
    parser: argparse.ArgumentParser, package: str, modules: dict[str, str], dest: str
) -> None:
    """One subcommand per ``name -> module`` of ``package``; each module exposes ``HELP``,
    ``add_arguments(parser)`` and ``run(args)`` (see ``run_module_subcommand``)."""
    sub = parser.add_subparsers(dest=dest, metavar=dest.upper(), required=True)
    for name, module_name in modules.items():
        module = importlib.import_module(f"{package}.{module_name}")
        cmd = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(cmd)
        cmd.set_defaults(_module_run=module.run)


def run_module_subcommand(args: argparse.Namespace) -> int:
    return int(args._module_run(args) or 0)
