"""The bad inputs of issue 44 (and issue 43's malformed YAML and JSONL), as one table.

Each row is a user mistake given to the command line: a bad config key or value, a bad
override, a missing file, malformed YAML, a malformed JSONL or parquet dataset, a bad plugin,
a bad model path, a chat template that refuses the system prompt, a run name that clashes.
Each must end in one ``error:`` line (no traceback) naming the file and line, or the key,
with what was expected; a non-zero exit status; in bounded time; and an earlier run in the
same run directory is left byte for byte as it was (``--overwrite`` is given, so that the
bad input, not the name clash, is what stops the run). The commands run in this process
(``relayrl.cli.main``), each with a deadline, so the table stays fast.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from relayrl.cli import main

DEADLINE_S = 120.0  # a case that has not ended by then hangs
NO_SYSTEM = (  # Gemma-style: the template itself refuses a system turn
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
)
ROW = {"id": "r0", "prompt": "What is 1 + 1?", "answer": "2"}


@dataclass(frozen=True)
class Case:
    """``argv(d)`` in the directory ``d`` (files written by ``files(d)``); the error line
    must hold every fragment (``{d}`` is replaced by the directory)."""

    argv: Callable[[Path], list[str]]
    fragments: tuple[str, ...]
    files: Callable[[Path], None] = lambda d: None


def write(name: str, content: str | bytes) -> Callable[[Path], None]:
    def make(d: Path) -> None:
        path = d / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)

    return make


def jsonl(*lines: str) -> str:
    return "".join(line + "\n" for line in lines)


GOOD_LINE = json.dumps(ROW)


def train(*extra: str) -> Callable[[Path], list[str]]:
    """``relayrl train --overwrite run.yaml`` over the earlier run ``prev``, plus ``extra``."""
    return lambda d: ["train", "--overwrite", str(d / "run.yaml"), *extra]


def config_file(name: str) -> Callable[[Path], list[str]]:
    return lambda d: ["train", "--overwrite", str(d / name), f"output_dir={d / 'runs'}"]


CASES: dict[str, Case] = {
    # config keys and values
    "unknown key": Case(train("optimiser.lr=1"), ("unknown config key 'optimiser'", "optim")),
    "wrong value type": Case(train("optim.lr=abc"), ("optim.lr", "expected float")),
    "value out of range": Case(train("algo.eps_low=3"), ("algo.eps_low", "less than 1")),
    "not one of the choices": Case(train("algo.is_level=tokens"), ("algo.is_level", "'token'")),
    "unknown task": Case(train("task.name=sudoku"), ("unknown task 'sudoku'",)),
    "unknown loss": Case(train("algo.loss=ppo2"), ("algo.loss", "ppo2", "decoupled")),
    "cispo with is_level": Case(
        train("algo.loss=cispo", "algo.is_level=token"), ("algo.is_level='token'", "cispo")
    ),
    "keys that exclude each other": Case(
        train("rollout.max_adapters=2"), ("rollout.max_adapters=2 needs model.lora",)
    ),
    "plugins not a list": Case(train("plugins=3"), ("plugins must be a list",)),
    # overrides
    "override without =": Case(train("optim.lr"), ("bad override 'optim.lr'", "KEY=VALUE")),
    "override without key": Case(train("=3"), ("bad override '=3'", "KEY=VALUE")),
    "config file as an override": Case(
        lambda d: ["config", "run.yaml"], ("bad override 'run.yaml'", "--config run.yaml")
    ),
    "override of a section": Case(train("model=3"), ("'model' must be a mapping",)),
    "override with an alias": Case(train("name=*x"), ("anchors and aliases",)),
    "override float for int": Case(train("train.total_steps=1e3"), ("train.total_steps", "int")),
    # files
    "missing config file": Case(config_file("absent.yaml"), ("absent.yaml' not found",)),
    "config is a directory": Case(config_file("runs"), ("runs' not found",)),
    # malformed YAML
    "tab indentation": Case(
        config_file("c.yaml"),
        ("c.yaml:3:", "not valid YAML", "'\\t'"),
        write("c.yaml", "a: 1\nb:\n\tc: 2\n"),
    ),
    "unclosed bracket": Case(
        config_file("c.yaml"), ("c.yaml:", "not valid YAML", "']'"), write("c.yaml", "name: [x\n")
    ),
    "unclosed quote": Case(
        config_file("c.yaml"), ("c.yaml:", "not valid YAML"), write("c.yaml", 'name: "x\n')
    ),
    "wrong type in the file": Case(
        config_file("c.yaml"),
        ("c.yaml:2:", "rollout.n_samples", "expected int"),
        write("c.yaml", "rollout:\n  n_samples: [1, 2]\n"),
    ),
    "section given a scalar": Case(
        config_file("c.yaml"),
        ("c.yaml:1:", "'model' must be a mapping"),
        write("c.yaml", "model: m\n"),
    ),
    "a list, not a mapping": Case(
        config_file("c.yaml"), ("must hold a mapping", "list"), write("c.yaml", "- a\n- b\n")
    ),
    "not UTF-8": Case(
        config_file("c.yaml"), ("c.yaml:2:", "not UTF-8"), write("c.yaml", b"a: 1\n\xff\n")
    ),
    "duplicate key": Case(
        config_file("c.yaml"), ("c.yaml:2:", "appears twice"), write("c.yaml", "seed: 1\nseed: 2\n")
    ),
    "unknown key in the file": Case(
        config_file("c.yaml"),
        ("c.yaml:2:", "unknown config key 'train.total_step'", "train.total_steps"),
        write("c.yaml", "train:\n  total_step: 3\n"),
    ),
    # malformed datasets (rollout.dataset, eval.datasets)
    "JSONL bad line": Case(
        train("rollout.dataset={d}/d.jsonl"),
        ("d.jsonl:2:", "bad JSON", "one JSON object per line"),
        write("d.jsonl", jsonl(GOOD_LINE, "{bad")),
    ),
    "JSONL missing field": Case(
        train("rollout.dataset={d}/d.jsonl"),
        ("d.jsonl:1:", "'answer'", "answer_field"),
        write("d.jsonl", jsonl(json.dumps({"id": "a", "prompt": "x"}))),
    ),
    "JSONL non-object line": Case(
        train("rollout.dataset={d}/d.jsonl"),
        ("d.jsonl:2:", "expected a JSON object, got list"),
        write("d.jsonl", jsonl(GOOD_LINE, "[1, 2]")),
    ),
    "JSONL not UTF-8": Case(
        train("rollout.dataset={d}/d.jsonl"),
        ("d.jsonl:2:", "not UTF-8"),
        write("d.jsonl", (jsonl(GOOD_LINE) + '{"id": "\xff"}\n').encode("latin-1")),
    ),
    "dataset file missing": Case(
        train("rollout.dataset={d}/absent.jsonl"), ("absent.jsonl", "not exist")
    ),
    "parquet not parquet": Case(
        train("rollout.dataset={d}/d.parquet"),
        ("d.parquet", "not a readable parquet file"),
        write("d.parquet", "garbage"),
    ),
    "held-out JSONL bad line": Case(
        train("eval.datasets=[{data: {d}/e.jsonl}]"),
        ("e.jsonl:2:", "bad JSON"),
        write("e.jsonl", jsonl(GOOD_LINE, "{bad")),
    ),
    # plugins
    "plugin syntax error": Case(
        lambda d: ["--plugin", str(d / "bi_syntax.py"), *train()(d)],
        ("bi_syntax.py:2: syntax error",),
        write("bi_syntax.py", "import os\nx = = 1\n"),
    ),
    "plugin import error": Case(
        lambda d: ["--plugin", str(d / "bi_import.py"), *train()(d)],
        ("No module named 'no_such_pkg_bi'", "bi_import.py:1"),
        write("bi_import.py", "import no_such_pkg_bi\n"),
    ),
    "plugin raises at import": Case(
        lambda d: ["--plugin", str(d / "bi_raises.py"), *train()(d)],
        ("boom at import", "RuntimeError at", "bi_raises.py:2"),
        write("bi_raises.py", "def f():\n    raise RuntimeError('boom at import')\nf()\n"),
    ),
    "plugin file missing": Case(
        lambda d: ["--plugin", str(d / "bi_absent.py"), *train()(d)],
        ("bi_absent.py", "no such file"),
    ),
    # the model
    "model path missing": Case(
        train("model.path={d}/nope"), ("model.path:", "nope", "not a directory")
    ),
    "model dir without config.json": Case(
        train("model.path={d}/runs"), ("model.path:", "has no config.json")
    ),
    "template refuses the system turn": Case(
        train("model.path={d}/gemma", "model.system_prompt=Be brief."),
        ("model.system_prompt:", "refuses a system message", "System role not supported"),
    ),
    # the run directory
    "resume and overwrite": Case(
        lambda d: ["train", "--overwrite", "--resume", str(d / "runs" / "prev")], ("give one",)
    ),
}


class Hung(Exception):
    """A case still running at its deadline."""


def run_cli(argv: list[str]) -> int:
    """``main(argv)`` with a deadline (SIGALRM: the command installs signal handlers, so it
    runs in the main thread): a case still running after ``DEADLINE_S`` hangs."""

    def hung(signum, frame):  # noqa: ARG001
        raise Hung(f"relayrl {' '.join(argv)} still running after {DEADLINE_S}s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, DEADLINE_S)
    try:
        return main(argv)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_model_dir) -> Path:
    """A run config over the tiny model, an earlier run ``prev`` it would overwrite, and a
    copy of the model whose chat template refuses a system turn."""
    import shutil

    d = tmp_path_factory.mktemp("bad_inputs")
    (d / "run.yaml").write_text(
        f"name: prev\noutput_dir: {d / 'runs'}\nmodel: {{path: {tiny_model_dir}, max_context: 64}}\n"
        "rollout: {prompts_per_step: 2, n_samples: 2, max_new_tokens: 8, server_mode: thread}\n"
        "train: {total_steps: 1, eval_every: 0, progress: false}\n"
        "eval: {num_problems: 2, max_new_tokens: 8}\nruntime: {threads: 1}\n"
    )
    prev = d / "runs" / "prev"
    (prev / "checkpoints").mkdir(parents=True)
    (prev / "config.yaml").write_text("name: prev\n")
    (prev / "train_summary.json").write_text('{"final_pass@1": 0.5}\n')
    (prev / "metrics.jsonl").write_text('{"step": 1}\n')
    gemma = d / "gemma"
    shutil.copytree(tiny_model_dir, gemma)
    tokenizer_config = json.loads((gemma / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = NO_SYSTEM
    (gemma / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return d


@pytest.mark.parametrize("name", list(CASES))
def test_a_bad_input_is_one_error_line_and_the_earlier_run_is_untouched(
    name, workdir, capsys, monkeypatch
):
    case = CASES[name]
    monkeypatch.chdir(workdir)
    monkeypatch.delenv("RELAYRL_PLUGINS", raising=False)
    case.files(workdir)
    before = snapshot(workdir / "runs")
    argv = [a.replace("{d}", str(workdir)) for a in case.argv(workdir)]
    code = run_cli(argv)
    out, err = capsys.readouterr()
    assert code != 0, f"{name}: exit 0\n{out}\n{err}"
    assert "Traceback" not in err + out, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), f"{name}:\n{err}"
    for fragment in case.fragments:
        assert fragment.replace("{d}", str(workdir)) in lines[0], (
            f"{name}: {fragment!r} not in {lines[0]}"
        )
    assert snapshot(workdir / "runs") == before, f"{name}: the earlier run was changed"


def test_a_name_clash_is_an_error_unless_overwrite_or_resume(workdir, capsys, monkeypatch):
    """Without --overwrite an earlier run of the same name stops a fresh start, untouched;
    --resume continues it (a finished run: nothing to resume, also untouched)."""
    monkeypatch.chdir(workdir)
    before = snapshot(workdir / "runs")
    assert run_cli(["train", str(workdir / "run.yaml")]) != 0
    err = capsys.readouterr().err
    assert err.startswith("error: run directory") and "already holds a run" in err, err
    assert "--resume" in err and "--overwrite" in err
    assert run_cli(["sft", str(workdir / "run.yaml")]) != 0
    assert "already holds a run" in capsys.readouterr().err
    assert snapshot(workdir / "runs") == before
