"""``relayrl eval --max-context N`` (issue 48): the context of an evaluation, with
``model.max_context``'s meaning, in process and on servers of a longer context; a
``--config``'s ``model.max_context`` by default. A prompt with no room left is not generated
(``too_long``), and a completion stops at the context
(``relayrl.eval.evaluate.generate_all``)."""

from __future__ import annotations

import json

import pytest

from relayrl.cli import main
from relayrl.models.loading import encode_prompt, load_tokenizer
from relayrl.tasks.registry import make_task
from tests.eval.test_eval_command import run_eval
from tests.eval.test_eval_remote import serve  # noqa: F401 - the fixture

NEW_TOKENS = 20
OPTIONS = ("--limit", "5", "--max-new-tokens", str(NEW_TOKENS), "--seed", "7", "--workers", "1")


@pytest.fixture
def prompt_lengths(tiny_model_dir) -> list[int]:
    tokenizer = load_tokenizer(tiny_model_dir)
    problems = make_task("arithmetic").problems("test", 5, seed=0)
    return [len(encode_prompt(tokenizer, p.prompt)) for p in problems]


def middle_context(lengths: list[int]) -> int:
    """A context some prompts fit and some do not."""
    context = sorted(lengths)[len(lengths) // 2] + 1
    assert 0 < sum(n >= context for n in lengths) < len(lengths)
    return context


def check_bounded(out, capsys, lengths: list[int], context: int) -> None:
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    summary = capsys.readouterr().out.strip().splitlines()[1]
    too_long = [n >= context for n in lengths]
    assert f"too_long_for_context={sum(too_long)}" in summary
    assert [r["too_long"] for r in rows] == too_long


def test_max_context_bounds_an_in_process_evaluation(
    tiny_model_dir, tmp_path, capsys, prompt_lengths
):
    context = middle_context(prompt_lengths)
    out = tmp_path / "capped.jsonl"
    assert run_eval(tiny_model_dir, "arithmetic", out, *OPTIONS, "--max-context", str(context)) == 0
    check_bounded(out, capsys, prompt_lengths, context)


def test_max_context_bounds_servers_of_a_longer_context(
    serve,  # noqa: F811
    tiny_model_dir,
    tmp_path,
    capsys,
    prompt_lengths,
):
    context = middle_context(prompt_lengths)
    url = serve()  # the model's whole context
    out = tmp_path / "remote.jsonl"
    extra = ("--server-url", url, "--max-context", str(context))
    assert run_eval(tiny_model_dir, "arithmetic", out, *OPTIONS, *extra) == 0
    check_bounded(out, capsys, prompt_lengths, context)


def test_the_configs_max_context_is_the_default(tiny_model_dir, tmp_path, capsys, prompt_lengths):
    context = middle_context(prompt_lengths)
    config = tmp_path / "run.yaml"
    config.write_text(f"model:\n  path: {tiny_model_dir}\n  max_context: {context}\n")
    out = tmp_path / "config.jsonl"
    argv = ["eval", "--config", str(config), "--data", "arithmetic", "--out", str(out)]
    assert main([*argv, "--threads", "1", *OPTIONS]) == 0
    check_bounded(out, capsys, prompt_lengths, context)


def test_a_context_below_two_tokens_is_one_error_line(tiny_model_dir, tmp_path, capsys):
    code = run_eval(tiny_model_dir, "arithmetic", tmp_path / "x.jsonl", "--max-context", "1")
    assert code != 0
    assert capsys.readouterr().err.strip() == "error: --max-context must be >= 2, got 1"


@pytest.mark.parametrize(
    ("given", "expected"), [((), "bfloat16"), (("--dtype", "float32"), "float32")]
)
def test_the_configs_rollout_dtype_is_the_engines_unless_given(
    tiny_model_dir, tmp_path, monkeypatch, given, expected
):
    """`relayrl eval --config` generates in what the config's servers generate in (the
    SmolLM2 recipe's bf16), not float32 whatever the config says."""
    import torch

    from relayrl.engine.engine import Engine

    built = []
    real = Engine.from_pretrained.__func__

    def spy(cls, path, options):
        engine = real(cls, path, options)
        built.append(next(engine.model.parameters()).dtype)
        return engine

    monkeypatch.setattr(Engine, "from_pretrained", classmethod(spy))
    config = tmp_path / "run.yaml"
    config.write_text(f"model:\n  path: {tiny_model_dir}\nrollout:\n  dtype: bfloat16\n")
    argv = ["eval", "--config", str(config), "--data", "arithmetic", "--threads", "1"]
    argv += ["--out", str(tmp_path / "e.jsonl"), "--limit", "2", "--max-new-tokens", "4", *given]
    assert main(argv) == 0
    assert built == [getattr(torch, expected)]


def test_the_configs_own_task_gives_its_params_and_seed(tiny_model_dir, tmp_path):
    """`relayrl eval --config run.yaml --data <its task>` evaluates the problems the run
    holds out (before: the task's default parameters, 4-digit chain sums for the SmolLM2
    recipe's 2-digit ones)."""
    import argparse

    from relayrl.cli.eval import _run_config, _task_defaults, add_arguments, load_eval_problems

    config_file = tmp_path / "run.yaml"
    config_file.write_text(
        f"model:\n  path: {tiny_model_dir}\ntask:\n  name: arithmetic\n  seed: 7\n"
        "  params: {max_steps: 3, max_value: 9}\n"
    )

    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def problems(*given: str):
        argv = ["--config", str(config_file), "--data", "arithmetic", "--limit", "20", *given]
        args = parser.parse_args(argv)
        _task_defaults(args, _run_config(args))
        return [p.prompt for p in load_eval_problems(args)]

    task = make_task("arithmetic", {"max_steps": 3, "max_value": 9})
    assert problems() == [p.prompt for p in task.problems("test", 20, seed=7)]
    default = make_task("arithmetic").problems("test", 20, seed=0)
    assert problems("--task-params", "{}", "--task-seed", "0") == [p.prompt for p in default]
