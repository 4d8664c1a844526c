"""What README.md and docs/*.md tell a user to type exists: every ``relayrl <command>`` (and
``relayrl bench|experiment <name>``) named in their code, every flag written after it, every
``configs/*.yaml`` they name, every repository path and ``make`` target README names. The
quick tour's shell block is run as far as it is cheap: ``relayrl config`` renders each
config it names with its overrides, and every other command's arguments are parsed (training,
serving and evaluation themselves are not run); each command has a ``--help``, and every
shipped config renders through ``relayrl config`` to a config that reads back the same.

The checks are functions of the markdown text, so that the last tests can show each fails
on a README naming a command, a flag or a file that does not exist."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest
import yaml

from relayrl.cli import COMMANDS, build_parser, main
from relayrl.config.loader import load_config
from relayrl.models.gguf import is_gguf_spec

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
SHELL_FENCES = ("bash", "sh", "console", "shell")
SPAN = re.compile(r"(`+)(.+?)\1", re.S)
INDENTED_COMMAND = re.compile(r"^ {4,}(relayrl .*)$", re.M)
# "relayrl" as a command word, and what follows it on its line
COMMAND = re.compile(r"(?:^|(?<=[\s;&|(]))relayrl[ \t]+([^\n]*)")
SEPARATORS = re.compile(r"\s(?:\|\|?|&&|;)\s")
COMMENT = re.compile(r"(?:^|\s)#(?!#).*$", re.M)  # a shell comment (not '#### N')
FLAG = re.compile(r"^--?[a-zA-Z][\w-]*")
GLOBAL_OPTIONS = {"--debug": 0, "--plugin": 1}  # before the command: option -> its values
CONFIG_PATH = re.compile(r"(?<![\w/.-])configs/[\w.-]+\.ya?ml")
REPO_PATH = re.compile(
    r"(?<![\w/.-])((?:configs|docs|scripts|relayrl|tests|\.ci)/[\w./-]*[\w/])(?![\w<{*])"
)
MAKE_TARGET = re.compile(r"(?<![\w-])make ([a-z][\w-]*)")


def code_texts(markdown: str) -> list[str]:
    """The text of every shell fence, code span and indented command line of a page."""
    fences = [(kind, body) for kind, body in FENCE.findall(markdown)]
    prose = FENCE.sub("", markdown)
    spans = [text.replace("\\|", "|") for _, text in SPAN.findall(prose)]
    shell = [body for kind, body in fences if kind in SHELL_FENCES]
    return shell + spans + INDENTED_COMMAND.findall(prose)


def relayrl_commands(markdown: str) -> list[str]:
    """Each ``relayrl …`` written in code, up to the end of its line or a ``|``/``&&``/``;``."""
    commands = []
    for text in code_texts(markdown):
        text = COMMENT.sub("", re.sub(r"\\\n", " ", text))  # continuation lines joined
        commands += [SEPARATORS.split(rest)[0].strip() for rest in COMMAND.findall(text)]
    return commands


def words(command: str) -> list[str]:
    """``command``'s words without the brackets and bars of a usage line."""
    try:
        raw = shlex.split(command)
    except ValueError:  # an unbalanced quote in a usage line
        raw = command.split()
    return [w.strip("[]()|,") for w in raw if w.strip("[]()|,")]


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # noqa: SLF001 - argparse keeps its subcommands here
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            return dict(action.choices)
    return {}


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}  # noqa: SLF001


def command_errors(command: str, parser: argparse.ArgumentParser) -> list[str]:
    """What in ``relayrl <command>`` does not exist: the command, a subcommand, a flag."""
    argv = words(command)
    while argv and argv[0] in GLOBAL_OPTIONS:
        argv = argv[1 + GLOBAL_OPTIONS[argv[0]] :]
    if not argv:
        return []
    name, argv = argv[0], argv[1:]
    commands = subparsers(parser)
    if name not in commands:
        return [f"relayrl {command}: no command {name!r} (commands: {sorted(commands)})"]
    current, known = commands[name], options(parser) | options(commands[name])
    nested = subparsers(current)
    if nested and argv and not argv[0].startswith("-"):
        named = argv[0].split("|")  # `relayrl bench async|trl`: each of them
        unknown = [n for n in named if n not in nested]
        if unknown:
            return [f"relayrl {command}: 'relayrl {name}' has no {unknown[0]!r} ({sorted(nested)})"]
        known |= {option for n in named for option in options(nested[n])}
        argv = argv[1:]
    flags = [FLAG.match(w).group(0) for w in argv if FLAG.match(w)]
    return [
        f"relayrl {command}: {flag} is not an option of it" for flag in flags if flag not in known
    ]


def page_command_errors(markdown: str) -> list[str]:
    parser = build_parser()
    return [e for command in relayrl_commands(markdown) for e in command_errors(command, parser)]


def missing_paths(markdown: str, pattern: re.Pattern[str]) -> list[str]:
    return sorted({p for p in pattern.findall(markdown) if not (ROOT / p).exists()})


def missing_make_targets(markdown: str) -> list[str]:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    named = {t for text in code_texts(markdown) for t in MAKE_TARGET.findall(text)}
    return sorted(named - targets)


# ------------------------------------------------------------------ the pages as they are


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_and_flag_a_page_names_exists(page: Path) -> None:
    assert page_command_errors(page.read_text()) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_config_a_page_names_exists(page: Path) -> None:
    assert missing_paths(page.read_text(), CONFIG_PATH) == []


def test_every_file_and_make_target_the_readme_names_exists() -> None:
    text = README.read_text()
    assert missing_paths(text, REPO_PATH) == []
    assert missing_make_targets(text) == []


def quick_tour() -> list[list[str]]:
    """The README's shell blocks' ``relayrl`` commands, as argv."""
    blocks = [body for kind, body in FENCE.findall(README.read_text()) if kind == "bash"]
    commands = [c for body in blocks for c in relayrl_commands(f"```bash\n{body}```\n")]
    return [shlex.split(c) for c in commands]


def test_the_quick_tour_names_the_main_commands() -> None:
    assert [argv[0] for argv in quick_tour()] == ["sft", "train", "serve", "eval", "grade"]


@pytest.mark.parametrize("argv", quick_tour(), ids=lambda argv: argv[0])
def test_each_quick_tour_command_parses_and_its_config_renders(argv: list[str], capsys) -> None:
    args = build_parser().parse_args(argv)  # an unknown flag or a missing argument: exit 2
    if getattr(args, "overrides", None) is not None and getattr(args, "config", None):
        assert main(["config", "--config", args.config, *args.overrides]) == 0
        rendered = yaml.safe_load(capsys.readouterr().out)
        assert rendered == load_config(args.config, args.overrides).model_dump(mode="json")


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_command_has_a_help(name: str, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main([name, "--help"])
    assert done.value.code == 0 and f"usage: relayrl {name}" in capsys.readouterr().out


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_each_shipped_config_renders_to_itself(path: Path, tmp_path: Path, capsys) -> None:
    config = load_config(path, resolve_model=False)
    if is_gguf_spec(config.model.path):
        pytest.skip("a packaged model is resolved by `make smollm2`; the schema is checked above")
    assert main(["config", "--config", str(path)]) == 0
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(capsys.readouterr().out)
    assert load_config(rendered) == load_config(path)


# ------------------------------------------------------------------ the checks catch a bad page


def test_the_checks_fail_on_a_command_a_flag_or_a_file_that_does_not_exist() -> None:
    page = """
```bash
relayrl trian configs/async.yaml   # a typo
relayrl eval --model m --data gsm8k --temprature 0.5 | tail -1
make dmeo
```
| `relayrl bench engnie [--quick]` | `relayrl train configs/nope.yaml` | [x](docs/nope.md) |
"""
    errors = page_command_errors(page)
    assert len(errors) == 3
    assert "no command 'trian'" in errors[0]
    assert "--temprature is not an option" in errors[1]
    assert "'relayrl bench' has no 'engnie'" in errors[2]
    assert missing_paths(page, CONFIG_PATH) == ["configs/nope.yaml"]
    assert missing_paths(page, REPO_PATH) == ["configs/nope.yaml", "docs/nope.md"]
    assert missing_make_targets(page) == ["dmeo"]
    good = "`relayrl --plugin p.py train configs/async.yaml --check` and `make demo`"
    assert page_command_errors(good) == [] and missing_make_targets(good) == []
