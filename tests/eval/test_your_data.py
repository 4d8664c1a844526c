"""Your own data without code: ``rollout.dataset`` / ``eval.datasets`` name the columns
(``prompt_field``, ``answer_field``, ``id_field``), a prompt template over the row's columns
and a grader by name; graders see the whole row; a saved ``DatasetDict``'s test split is the
default held-out set, and a dataset without one is an error, never the synthetic task."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.config.loader import load_config
from relayrl.errors import RelayError
from relayrl.eval.sets import SET_KEY, eval_problems
from relayrl.rewards.dispatch import grade_detail
from relayrl.tasks.base import Problem
from relayrl.tasks.registry import make_task
from relayrl.train.run.setup import train_problems

QA = {"prompt_field": "q", "answer_field": "a", "template": "Question: {q}\nOptions: {choices}"}


def source(data: Path, **keys: str) -> str:
    """A data source as a config value (JSON is YAML)."""
    return json.dumps({"data": str(data), **keys})


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def qa_rows(n: int) -> list[dict]:
    return [
        {"q": f"What is {i} + 1?", "a": str(i + 1), "choices": [str(i), str(i + 1)], "bonus": i % 2}
        for i in range(n)
    ]


def test_columns_template_and_the_whole_row(tmp_path: Path) -> None:
    data = write_rows(tmp_path / "qa.jsonl", qa_rows(3))
    config = load_config(
        None, [f"rollout.dataset={source(data, **QA)}", "eval.datasets=[{data: task}]"]
    )
    problems = train_problems(config, None)
    assert [p.id for p in problems] == ["qa-1", "qa-2", "qa-3"]  # no id column: line ids
    assert problems[1].prompt == 'Question: What is 1 + 1?\nOptions: ["1", "2"]'
    assert problems[1].answer == "2" and problems[1].grader == "math"
    assert problems[1].row == qa_rows(3)[1]  # every column, for the grader
    assert Problem("p", "q", "1", "math").row == {}


def test_bad_columns_are_one_error_naming_file_key_and_columns(tmp_path: Path) -> None:
    data = write_rows(tmp_path / "qa.jsonl", qa_rows(2))
    columns = "['a', 'bonus', 'choices', 'q']"
    bad_answer = load_config(
        None, [f"rollout.dataset={source(data, prompt_field='q', answer_field='ans')}"]
    )
    with pytest.raises(RelayError) as err:
        train_problems(bad_answer, None)
    assert str(err.value) == (
        f"{data}:1: rollout.dataset.answer_field='ans': no such column; "
        f"the row's columns: {columns}"
    )
    bad_template = load_config(
        None,
        [
            f"eval.datasets=[{source(data, answer_field='a', template='{q} {options}')}]",
        ],
    )
    with pytest.raises(RelayError) as err:
        eval_problems(bad_template, make_task("arithmetic"))
    message = str(err.value)
    assert message.startswith(f"{data}:1: eval.datasets[0].template names column {{options}}")
    assert columns in message and "\n" not in message
    with pytest.raises(RelayError, match="grader.*did you mean 'exact'"):
        load_config(None, [f"rollout.dataset={source(data, grader='exakt')}"])
    with pytest.raises(RelayError, match="data: task .* takes no"):
        load_config(None, ["eval.datasets=[{data: task, grader: exact}]"])


def test_the_exact_grader_compares_text_not_numbers() -> None:
    def problem(gold: str, grader: str) -> Problem:
        return Problem("p", "q", gold, grader, {"math": {"modes": ["boxed", "hash"]}})

    assert grade_detail(problem("7.0", "math"), "#### 7")[0] == 1.0  # same number
    assert grade_detail(problem("7.0", "exact"), "#### 7")[0] == 0.0  # not the same text
    assert grade_detail(problem("B", "exact"), "so \\boxed{ B }")[0] == 1.0
    assert grade_detail(problem("B", "exact"), "B")[1] == {"extracted": None, "method": "no_answer"}


def test_a_saved_test_split_is_the_default_held_out_set(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()

    def split(ids: list[str]) -> object:
        return datasets.Dataset.from_dict(
            {"uid": ids, "question": [f"{i}?" for i in ids], "gold": ["1"] * len(ids)}
        )

    both = tmp_path / "both"
    datasets.DatasetDict({"train": split(["t0", "t1"]), "test": split(["s0"])}).save_to_disk(
        str(both)
    )
    columns = {"id_field": "uid", "prompt_field": "question", "answer_field": "gold"}
    config = load_config(None, [f"rollout.dataset={source(both, **columns, grader='exact')}"])
    assert [p.id for p in train_problems(config, None)] == ["t0", "t1"]
    held_out = eval_problems(config, make_task("arithmetic"))
    assert [(p.id, p.grader, p.meta[SET_KEY]) for p in held_out] == [("s0", "exact", "both")]

    train_only = tmp_path / "train_only"
    datasets.DatasetDict({"train": split(["t0"])}).save_to_disk(str(train_only))
    for data in (train_only, write_rows(tmp_path / "mine.jsonl", qa_rows(2))):
        config = load_config(None, [f"rollout.dataset={data}"])
        with pytest.raises(RelayError, match="has no test split .* eval.datasets is empty"):
            eval_problems(config, make_task("arithmetic"))
    assert "its splits: ['train']" in _error(train_only)


def _error(data: Path) -> str:
    with pytest.raises(RelayError) as err:
        eval_problems(load_config(None, [f"rollout.dataset={data}"]), make_task("arithmetic"))
    return str(err.value)


def test_a_run_without_a_held_out_set_stops_before_any_process(tmp_path, tiny_model_dir):
    from relayrl.train.run import run_train
    from tests.train.conftest import rl_config

    data = write_rows(tmp_path / "mine.jsonl", qa_rows(4))
    config = rl_config(tmp_path, tiny_model_dir, f"rollout.dataset={source(data, **QA)}")
    with pytest.raises(RelayError, match="has no test split"):
        run_train(config)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


PLUGIN = '''
from relayrl.rewards.dispatch import register_grader


@register_grader("row_bonus")
def row_bonus(problem, completion):
    """The reward is the row's own bonus column: only a grader that sees the row knows it."""
    return float(problem.row["bonus"]), {}
'''


def test_a_run_trains_on_your_columns_graded_by_the_named_grader(tmp_path, tiny_model_dir):
    """Two steps on q/a rows through a template, rewarded by the grader the config names
    (a plugin's that reads a column no built-in knows), evaluated on a file of the same
    shape by the built-in exact grader."""
    from relayrl.train.run import run_train
    from tests.train.conftest import rl_config

    plugin = tmp_path / "bonus_plugin.py"
    plugin.write_text(PLUGIN)
    rows = qa_rows(8)
    train = write_rows(tmp_path / "train.jsonl", rows)
    test = write_rows(tmp_path / "test.jsonl", qa_rows(4))
    config = rl_config(
        tmp_path,
        tiny_model_dir,
        f"plugins=[{plugin}]",
        f"rollout.dataset={source(train, **QA, grader='row_bonus')}",
        f"eval.datasets=[{source(test, **QA, grader='exact', name='qa')}]",
        "train.total_steps=2",
        "train.log_text=true",
    )
    run_train(config)
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").open()]
    assert len(samples) == 2 * 2 * 4
    for sample in samples:
        row = rows[int(sample["prompt_id"].rsplit("-", 1)[1]) - 1]
        assert sample["reward"] == float(row["bonus"]), sample
        assert sample["prompt_text"].startswith(f"Question: {row['q']}\nOptions: ")
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    final = [m for m in metrics if m.get("final")][-1]
    assert final["eval_problems/qa"] == 4 and "eval_pass@1/qa" in final
