"""The realised staleness that `relayrl train` reports on its closing lines."""

from __future__ import annotations

import json
from pathlib import Path

from relayrl.cli.train import result_lines
from relayrl.train.metrics import realised_staleness
from relayrl.train.run import TrainResult


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_realised_staleness_is_the_mean_of_step_means_and_the_max(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    _write(
        metrics,
        [
            {"step": 0, "version": 0, "eval_pass@1": 0.5},  # an evaluation row: no staleness
            {"step": 1, "staleness_mean": 0.0, "staleness_max": 0.0},
            {"step": 2, "staleness_mean": 1.5, "staleness_max": 3.0},
            {"step": 3, "staleness_mean": 3.0, "staleness_max": 4.0},
            {"step": 3, "final": True, "eval_pass@1": 0.9},
        ],
    )
    assert realised_staleness(metrics) == {"staleness_mean": 1.5, "staleness_max": 4.0}


def test_realised_staleness_of_a_run_without_steps_is_empty(tmp_path: Path) -> None:
    assert realised_staleness(tmp_path / "missing.jsonl") == {}
    _write(tmp_path / "metrics.jsonl", [{"step": 0, "eval_pass@1": 0.5}])
    assert realised_staleness(tmp_path / "metrics.jsonl") == {}


def test_result_lines_put_staleness_before_the_final_pass_line(tmp_path: Path) -> None:
    summary = {"staleness_mean": 1.604, "staleness_max": 4.0}
    result = TrainResult(tmp_path, 80, 0.914, seconds=121.26, summary=summary)
    assert result_lines(result) == [
        "train_seconds=121.3 steps=80 staleness_mean=1.60 staleness_max=4",
        "final_pass@1=0.91",
    ]
    bare = TrainResult(tmp_path, 3, None, seconds=2.0)
    assert result_lines(bare) == ["train_seconds=2.0 steps=3"]
