"""Options anywhere on the command line (relayrl.cli.intermixed): for every command that
takes a config and KEY=VALUE overrides, ``CMD CONFIG --opt V KEY=V`` parses as
``CMD --opt V CONFIG KEY=V`` does."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import yaml

from relayrl.cli import build_parser, main

ASYNC = str(Path(__file__).resolve().parents[1] / "configs" / "async.yaml")


def parsed(argv: list[str]) -> dict:
    namespace = vars(build_parser().parse_args(argv))
    return {k: v for k, v in namespace.items() if not k.startswith("_")}


@pytest.mark.parametrize(
    ("options_first", "options_between"),
    [
        (
            ["train", "--plugin", "p.py", "C.yaml", "a.b=1", "c=2"],
            ["train", "C.yaml", "--plugin", "p.py", "a.b=1", "c=2"],
        ),
        (
            ["train", "--plugin", "p.py", "--check", "C.yaml", "a.b=1", "c=2"],
            ["train", "C.yaml", "a.b=1", "--plugin", "p.py", "c=2", "--check"],
        ),
        (
            ["train", "--replay-from", "R", "C.yaml", "a=1", "b=2"],
            ["train", "C.yaml", "a=1", "--replay-from", "R", "b=2"],
        ),
        (
            ["train", "--resume", "R", "a=1", "b=2"],
            ["train", "a=1", "--resume", "R", "b=2"],
        ),
        (["check", "--plugin", "p", "C.yaml", "a=1"], ["check", "C.yaml", "--plugin", "p", "a=1"]),
        (["sft", "--debug", "C.yaml", "a=1", "b=2"], ["sft", "C.yaml", "a=1", "--debug", "b=2"]),
        (
            ["demo", "--config", "C.yaml", "--plugin", "p", "a=1", "b=2"],
            ["demo", "a=1", "--plugin", "p", "b=2", "--config", "C.yaml"],
        ),
        (
            ["config", "--config", "C.yaml", "a=1", "b=2"],
            ["config", "a=1", "--config", "C.yaml", "b=2"],
        ),
        (
            ["bench", "--plugin", "p", "async", "--quick", "--steps", "3", "a=1", "b=2"],
            ["bench", "--plugin", "p", "async", "a=1", "--quick", "b=2", "--steps", "3"],
        ),
    ],
)
def test_options_anywhere_parse_alike(options_first, options_between):
    assert parsed(options_between) == parsed(options_first)


def test_an_override_after_an_option_is_applied(tmp_path):
    plugin = tmp_path / "anywhere_plugin.py"
    plugin.write_text("IMPORTED = True\n")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(
            [
                "config",
                "--config",
                ASYNC,
                "rollout.eta=2",
                "--plugin",
                str(plugin),
                "rollout.n_samples=4",
            ]  # fmt: skip
        )
    assert code == 0
    config = yaml.safe_load(out.getvalue())
    assert config["rollout"]["eta"] == 2 and config["rollout"]["n_samples"] == 4
    assert str(plugin) in config["plugins"]


def test_an_unknown_option_is_still_refused():
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        build_parser().parse_args(["train", "C.yaml", "--no-such-option", "a=1"])
