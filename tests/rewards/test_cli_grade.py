"""``relayrl grade`` end to end through relayrl.cli.main."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.cli import main


def test_grade_reports_rows_and_accuracy(
    shared_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
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
            str(shared_data),
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
    assert "missing predictions for 1316 of 1319 ids" in captured.err
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
