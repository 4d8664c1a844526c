"""``eval.datasets``: the held-out sets a run evaluates on, each with its own grader, and the
per-set pass@k / maj@k the metrics row and the dashboard show."""

from __future__ import annotations

import json

import pytest

from relayrl.config.loader import load_config
from relayrl.errors import RelayError
from relayrl.eval.sets import SET_KEY, eval_problems, interleave, set_metrics, set_summaries
from relayrl.tasks.base import Problem
from relayrl.tasks.registry import make_task
from relayrl.train.dashboard import status_line
from tests.conftest import FIXTURE_DATA


@pytest.fixture
def fixture_data(monkeypatch):
    monkeypatch.setenv("RELAYRL_DATA", str(FIXTURE_DATA))


def test_sets_keep_their_graders_and_are_interleaved(fixture_data):
    config = load_config(
        None,
        [
            "eval.num_problems=3",
            "eval.datasets=[{data: task}, {data: gsm8k, limit: 2}, {data: humaneval, limit: 1}]",
        ],
    )
    problems = eval_problems(config, make_task("arithmetic"))
    tags = [(p.meta[SET_KEY], p.grader) for p in problems]
    assert tags == [
        ("arithmetic", "math"),
        ("gsm8k", "math"),
        ("humaneval", "code"),
        ("arithmetic", "math"),
        ("gsm8k", "math"),
        ("arithmetic", "math"),
    ]
    assert problems[1].id == "gsm8k-test-00000" and problems[2].id == "HumanEval/0"
    assert problems[0].id == make_task("arithmetic").problems("test", 1, 0)[0].id


def test_training_on_a_dataset_evaluates_on_its_test_split(fixture_data):
    task = make_task("arithmetic")
    on_gsm = load_config(None, ["rollout.dataset=gsm8k_train", "eval.num_problems=5"])
    problems = eval_problems(on_gsm, task)
    assert [p.id for p in problems] == [f"gsm8k-test-0000{i}" for i in range(5)]
    assert {p.meta[SET_KEY] for p in problems} == {"gsm8k"}
    synthetic = eval_problems(load_config(None, ["eval.num_problems=4"]), task)
    assert synthetic == task.problems("test", 4, 0)  # unchanged: untagged, the task's split
    on_file = load_config(None, ["rollout.dataset=mine.jsonl", "eval.num_problems=4"])
    with pytest.raises(RelayError, match="rollout.dataset=mine.jsonl has no test split"):
        eval_problems(on_file, task)  # never the synthetic task's split in its place


def test_bad_sets_are_clear_errors(fixture_data):
    with pytest.raises(RelayError, match=r"eval.datasets.*grader.*did you mean 'math'"):
        load_config(None, ["eval.datasets=[{data: x.jsonl, grader: mathh}]"])
    config = load_config(None, ["eval.datasets=[{data: gsm8k}, {data: gsm8k}]"])
    with pytest.raises(RelayError, match="share a name"):
        eval_problems(config, make_task("arithmetic"))


def test_per_set_pass_and_maj_at_k_by_hand():
    def p(i: int, name: str) -> Problem:
        return Problem(f"p{i}", "q", "1", "math", {SET_KEY: name})

    problems = [p(0, "a"), p(1, "b"), p(2, "a")]
    correct = [[True, False], [True, True], [False, False]]
    answers = [["1", "2"], ["1", "1"], ["3", "3"]]
    per_set = set_summaries(problems, correct, answers, [2])
    # set a: pass@1 = (1/2 + 0) / 2; pass@2 = (1 + 0) / 2; maj@2: tie "1"/"2" -> first seen
    # "1" (correct) for p0, "3" wrong for p2
    assert per_set["a"] == {"pass@1": 0.25, "problems": 2.0, "pass@2": 0.5, "maj@2": 0.5}
    assert per_set["b"] == {"pass@1": 1.0, "problems": 1.0, "pass@2": 1.0, "maj@2": 1.0}
    row = set_metrics(per_set)
    assert row["eval_pass@1/a"] == 0.25 and row["eval_maj@2/b"] == 1.0
    line = status_line({"eval_pass@1": 0.5, **row, "staleness_mean": 1.0})
    assert "eval pass@1 0.50 | a 0.25 | b 1.00 | stale 1.00" in line
    assert interleave([[1, 2, 3], [4]]) == [1, 4, 2, 3]


def test_a_run_logs_each_sets_pass_at_1(tmp_path, tiny_model_dir, fixture_data):
    """A real 1-step run evaluating on its task and on GSM8K: the final row holds both."""
    from relayrl.train.run import run_train
    from tests.train.conftest import parity_grader, rl_config

    config = rl_config(
        tmp_path,
        tiny_model_dir,
        "train.total_steps=1",
        "eval.num_problems=3",
        "eval.datasets=[{data: task}, {data: gsm8k, limit: 2, name: gsm}]",
    )
    run_train(config, grader=parity_grader)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    final = [r for r in rows if r.get("final")][-1]
    assert final["eval_problems"] == 5
    assert final["eval_problems/arithmetic"] == 3 and final["eval_problems/gsm"] == 2
    for name in ("arithmetic", "gsm"):
        assert 0.0 <= final[f"eval_pass@1/{name}"] <= 1.0
    pooled = (3 * final["eval_pass@1/arithmetic"] + 2 * final["eval_pass@1/gsm"]) / 5
    assert final["eval_pass@1"] == pytest.approx(pooled)
