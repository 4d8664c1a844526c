"""``relayrl eval`` reads a dataset file as training reads ``rollout.dataset``:
``--prompt-field``, ``--answer-field``, ``--id-field``, ``--template`` and ``--grader`` are
that key's settings as flags, read by the same reader (the same problems, prompt for
prompt), and a missing column is one ``error:`` line naming the flag, the file and row, the
row's columns and the nearest one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.cli import build_parser, main
from relayrl.cli.eval import load_eval_problems
from relayrl.config.loader import load_config
from relayrl.tasks.base import Problem
from relayrl.train.run.setup import train_problems

SETTINGS = {
    "prompt_field": "question",
    "answer_field": "solution",
    "id_field": "ident",
    "template": "What is {question}? One of {choices}.",
    "grader": "exact",
}
FLAGS = [part for key, value in SETTINGS.items() for part in ("--" + key.replace("_", "-"), value)]
COLUMNS = "['choices', 'ident', 'question', 'solution']"


def write_qa(path: Path, n: int, drop: dict[int, str] | None = None) -> Path:
    """``n`` rows of a question, its choices, the solution and an id; ``drop``: row number
    (1-based) -> a column that row lacks."""
    rows = []
    for i in range(n):
        row = {
            "ident": f"q{i}",
            "question": f"{i} + 1",
            "choices": [i, i + 1],
            "solution": str(i + 1),
        }
        row.pop((drop or {}).get(i + 1, ""), None)
        rows.append(json.dumps(row) + "\n")
    path.write_text("".join(rows))
    return path


def seen(problem: Problem) -> tuple:
    """What a problem is to generation and grading."""
    return (
        problem.id,
        problem.prompt,
        problem.answer,
        problem.grader,
        problem.row,
        problem.meta.get("math"),
    )


def test_eval_reads_the_file_as_training_reads_rollout_dataset(tmp_path: Path) -> None:
    data = write_qa(tmp_path / "qa.jsonl", 5)
    args = build_parser().parse_args(["eval", "--model", "m", "--data", str(data), *FLAGS])
    evaluated = load_eval_problems(args)
    config = load_config(
        None,
        [
            f"rollout.dataset={json.dumps({'data': str(data), **SETTINGS})}",
            "eval.datasets=[{data: task}]",
        ],
    )
    trained = train_problems(config, None)
    assert [seen(p) for p in evaluated] == [seen(p) for p in trained]
    assert seen(evaluated[1])[:4] == ("q1", "What is 1 + 1? One of [1, 2].", "2", "exact")
    args.limit = 2
    assert [p.id for p in load_eval_problems(args)] == ["q0", "q1"]


def test_eval_grades_a_file_with_its_own_columns(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write_qa(tmp_path / "qa.jsonl", 3)
    out = tmp_path / "eval.jsonl"
    argv = ["eval", "--model", str(tiny_model_dir), "--data", str(data), "--threads", "1"]
    argv += ["--max-new-tokens", "4", "--workers", "1", "--out", str(out), *FLAGS]
    assert main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["q0", "q1", "q2"] and all(
        len(r["rewards"]) == 1 for r in rows
    )


def without(flag: str) -> list[str]:
    i = FLAGS.index(flag)
    return FLAGS[:i] + FLAGS[i + 2 :]


@pytest.mark.parametrize(
    ("flags", "drop", "message"),
    [
        (
            [*without("--answer-field"), "--answer-field", "soluton"],
            None,
            "{data}:1: --answer-field='soluton': no such column; the row's columns: "
            f"{COLUMNS}; did you mean 'solution'?",
        ),
        (
            [*without("--id-field"), "--id-field", "id"],
            None,
            f"{{data}}:1: --id-field='id': no such column; the row's columns: {COLUMNS}",
        ),
        (
            FLAGS,
            {3: "solution"},
            "{data}:3: --answer-field='solution': no such column; the row's columns: "
            "['choices', 'ident', 'question']",
        ),
        (
            [*without("--template"), "--template", "{problem} of {choises}"],
            None,
            "{data}:1: --template names column {choises}, which the row lacks; the row's "
            f"columns: {COLUMNS} ({{problem}} is the prompt field's text); did you mean "
            "'choices'?",
        ),
        (
            [*without("--template"), "--prompt-field", "questoin"],
            None,
            "{data}:1: --prompt-field='questoin': no such column; the row's columns: "
            f"{COLUMNS}; did you mean 'question'?",
        ),
        (
            [*without("--grader"), "--grader", "exakt"],
            None,
            "--grader: unknown grader 'exakt' (did you mean 'exact'?); expected one of ",
        ),
    ],
    ids=["answer typo", "no id column", "a later row", "template typo", "prompt typo", "grader"],
)
def test_a_missing_column_is_one_error_line_naming_the_flag_and_the_file(
    flags: list[str],
    drop: dict[int, str] | None,
    message: str,
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = write_qa(tmp_path / "qa.jsonl", 4, drop)
    argv = ["eval", "--model", str(tiny_model_dir), "--data", str(data), *flags]
    assert main(argv) != 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: " + message.replace("{data}", str(data)))


def test_a_synthetic_task_takes_no_column_flags(tiny_model_dir: Path, capsys) -> None:
    argv = ["eval", "--model", str(tiny_model_dir), "--data", "arithmetic", "--template", "{x}"]
    assert main(argv) != 0
    assert capsys.readouterr().err.startswith(
        "error: --template: --data 'arithmetic' is a synthetic task"
    )
