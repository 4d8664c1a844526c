"""``relayrl grade`` end to end through relayrl.cli.main."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.cli import main
from tests.conftest import rows_in


def test_grade_reports_rows_and_accuracy(
    benchmark_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    preds = tmp_path / "preds.jsonl"
    preds.write_text(
        "\n".join(
            [
                json.dumps({"id": "gsm8k-test-00000", "completion": "So she makes $18.\n#### 18"}),
                json.dumps({"id": "gsm8k-test-00001", "completion": "#### 4"}),
                "{this is not json",
                json.dumps({"id": "gsm8k-test-99999", "completion": "#### 1"}),
                json.dumps({"id": "gsm8k-test-00002", "text": "no completion field"}),
                json.dumps({"id": "gsm8k-test-00003", "completion": "The answer is 540."}),
            ]
        )
        + "\n"
    )
    out = tmp_path / "verdicts.jsonl"
    code = main(
        [
            "grade",
            "--data",
            "gsm8k",
            "--data-root",
            str(benchmark_data),
            "--predictions",
            str(preds),
            "--out",
            str(out),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0
    assert captured.out.strip().splitlines()[-1] == "accuracy=0.6667"
    assert f"{preds}:3: malformed row" in captured.err
    assert f"{preds}:4: unknown id 'gsm8k-test-99999'" in captured.err
    assert f"{preds}:5: malformed row" in captured.err
    rows = rows_in(benchmark_data, "gsm8k/test.jsonl")
    assert f"missing predictions for {rows - 3} of {rows} ids" in captured.err
    verdicts = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(v["id"], v["line"], v["correct"]) for v in verdicts] == [
        ("gsm8k-test-00000", 1, True),
        ("gsm8k-test-00001", 2, False),
        ("gsm8k-test-00003", 6, True),
    ]


def test_grade_user_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["grade", "--data", "gsm8", "--predictions", str(tmp_path / "none.jsonl")])
    assert code == 2
    assert "did you mean 'gsm8k'" in capsys.readouterr().err


def test_a_humaneval_file_given_by_path_is_graded_by_the_code_grader(
    benchmark_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A user file in HumanEval's schema is recognised as code: its canonical solutions pass
    (graded by the math grader they would all score 0)."""
    rows = [json.loads(line) for line in (benchmark_data / "humaneval/test.jsonl").open()][:3]
    data = tmp_path / "my_humaneval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    preds = tmp_path / "preds.jsonl"
    preds.write_text(
        "".join(
            json.dumps(
                {
                    "id": r["id"],
                    "completion": f"```python\n{r['prompt']}{r['canonical_solution']}```",
                }
            )
            + "\n"
            for r in rows
        )
    )
    assert main(["grade", "--data", str(data), "--predictions", str(preds)]) == 0
    captured = capsys.readouterr()
    assert "with grader code (recognised from the dataset)" in captured.err
    assert captured.out.strip().splitlines()[-1] == "accuracy=1.0000"


def test_a_file_of_unknown_schema_needs_a_grader(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "odd.jsonl"
    data.write_text(json.dumps({"id": "a", "prompt": "hi", "gold": "1"}) + "\n")
    preds = tmp_path / "preds.jsonl"
    preds.write_text(json.dumps({"id": "a", "completion": "#### 1"}) + "\n")
    assert main(["grade", "--data", str(data), "--predictions", str(preds)]) != 0
    err = capsys.readouterr().err
    assert f"{data}:1: cannot tell which grader" in err and "'gold'" in err
    code = main(
        ["grade", "--data", str(data), "--predictions", str(preds), "--answer-field", "gold"]
    )
    assert code == 0 and capsys.readouterr().out.strip().endswith("accuracy=1.0000")
