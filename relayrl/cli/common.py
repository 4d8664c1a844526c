"""Arguments shared by several commands: a run config and its overrides, ``--overwrite``,
and a ``--data`` file's columns, template and grader (``relayrl eval``, ``relayrl grade``),
read as :class:`relayrl.config.schema.DataSource` (``rollout.dataset``) reads them."""

from __future__ import annotations

import argparse
import importlib

from relayrl.errors import RelayError
from relayrl.tasks.datasets import FLAGS, setting_name


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


# --data's row settings: DataSource key -> (metavar, help); each flag (--prompt-field for
# prompt_field) means what that key means in a run config's rollout.dataset
DATA_SOURCE_OPTIONS: dict[str, tuple[str, str]] = {
    "prompt_field": (
        "COLUMN",
        "column of the prompt text, {problem} in --template (default prompt)",
    ),
    "answer_field": ("COLUMN", "column of the gold answer (default answer)"),
    "id_field": (
        "COLUMN",
        "column of the row's id (default: id when the rows have one, else the row's number)",
    ),
    "template": (
        "TEXT",
        "the prompt: {column} is replaced by the row's column (a list or number as JSON), "
        "{problem} by the prompt column, other braces stay, e.g. 'What is {question}? One of "
        "{choices}.' (default: the prompt column as is; a known dataset: its own)",
    ),
    "grader": (
        "NAME",
        "grader by name: math | exact | code | countdown | a plugin's (default: recognised "
        "from the rows); it sees the whole row as problem.row",
    ),
}


def add_data_source_arguments(parser: argparse.ArgumentParser) -> None:
    """:data:`DATA_SOURCE_OPTIONS` as flags: how ``--data``'s rows become problems, as the
    run config's ``rollout.dataset`` keys of the same names say (docs/your-own.md)."""
    group = parser.add_argument_group(
        "columns, prompt template and grader of --data (rollout.dataset's keys as flags)"
    )
    for option, (metavar, help_text) in DATA_SOURCE_OPTIONS.items():
        group.add_argument(setting_name(FLAGS, option), metavar=metavar, help=help_text)


def data_source(args: argparse.Namespace):
    """``--data`` and :data:`DATA_SOURCE_OPTIONS`' flags as the validated
    :class:`~relayrl.config.schema.DataSource` a run config's ``rollout.dataset`` would be;
    read it with ``relayrl.eval.sets.load_source(source, FLAGS, ...)`` so that errors name
    the flags. An invalid value (an unknown grader) is an error naming its flag."""
    from pydantic import ValidationError

    from relayrl.config.schema import DataSource

    options = {option: getattr(args, option) for option in DATA_SOURCE_OPTIONS}
    try:
        return DataSource(data=args.data, **options)
    except ValidationError as exc:
        first = exc.errors()[0]
        flag = setting_name(FLAGS, str(first["loc"][0]) if first["loc"] else "data")
        reason = (first.get("ctx") or {}).get("error", first["msg"])
        raise RelayError(f"{flag}: {reason}") from None


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
