"""A grader that raises during evaluation scores 0 and its first error is printed once, as in
training: the run keeps its final model and summary (issue 44 item 1)."""

from __future__ import annotations

import json

import pytest

from relayrl.eval import evaluate as evaluation
from relayrl.eval.evaluate import in_process_grader
from relayrl.rewards.dispatch import register_grader
from relayrl.rewards.pool import FirstGraderError
from relayrl.tasks.base import Problem
from relayrl.train.run import run_train
from tests.train.conftest import parity_grader, rl_config


def raising_grader(problem: Problem, completion: str) -> float:
    raise ValueError(f"grader bug on {problem.id}")


@pytest.fixture(autouse=True)
def first_error_unprinted(monkeypatch):
    """This process's first in-process grading error not yet printed."""
    monkeypatch.setattr(evaluation, "GRADER_ERRORS", FirstGraderError("scored 0 in evaluation"))


def test_a_raising_grader_scores_zero_and_is_printed_once(capsys):
    register_grader("ge_raises", safe=True)(raising_grader)
    problems = [Problem(f"p{i}", "x", "1", "ge_raises") for i in range(3)]
    verdicts = in_process_grader([(p, "#### 1") for p in problems])
    assert [v.reward for v in verdicts] == [0.0, 0.0, 0.0]
    err = capsys.readouterr().err
    assert err.count("warning: a grader raised") == 1
    assert "problem 'p0' (grader 'ge_raises')" in err and "grader bug on p0" in err


def test_a_run_whose_held_out_grader_raises_keeps_its_model_and_summary(
    tmp_path, tiny_model_dir, capsys
):
    """Training rewards by ``parity_grader``; the held-out set names a grader that raises:
    the final evaluation scores 0 instead of ending the run."""
    register_grader("ge_raises_eval", safe=True)(raising_grader)
    data = tmp_path / "held_out.jsonl"
    data.write_text(json.dumps({"id": "h0", "prompt": "What is 1 + 1?", "answer": "2"}) + "\n")
    config = rl_config(
        tmp_path,
        tiny_model_dir,
        "rollout.lag=fixed",
        "train.total_steps=1",
        f"eval.datasets=[{{data: {data}, grader: ge_raises_eval, name: held}}]",
    )
    result = run_train(config, grader=parity_grader)
    assert result.final_pass_at_1 == 0.0
    assert (result.run_dir / "final_model" / "config.json").is_file()
    summary = json.loads((result.run_dir / "train_summary.json").read_text())
    assert summary["final_pass@1"] == 0.0
    assert "grader bug on h0" in capsys.readouterr().err
