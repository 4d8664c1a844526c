import json
from pathlib import Path

import pytest

from relayrl.cli import main
from relayrl.errors import RelayError
from relayrl.report.build import CHARTS, build_report
from relayrl.train.rl import run_train
from tests.train.conftest import parity_grader, rl_config

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, tiny_model_dir) -> Path:
    """A real 3-step asynchronous run (η = 1) of the tiny model."""
    tmp = tmp_path_factory.mktemp("report_run")
    run_train(
        rl_config(tmp, tiny_model_dir, "rollout.eta=1", "train.eval_every=2"), grader=parity_grader
    )
    return tmp / "run"


def test_report_from_a_real_run_has_every_chart(short_run, capsys):
    assert main(["report", str(short_run)]) == 0
    out = capsys.readouterr().out
    page = short_run / "report" / "index.html"
    assert str(page) in out
    text = page.read_text()
    for name in CHARTS:
        png = short_run / "report" / f"{name}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC, name
        assert f"alt='{name}'" in text  # embedded: the page is self-contained
    assert "Best and worst sampled trajectories" in text
    assert text.count("<h3>step ") >= 2


def test_report_with_missing_optional_metrics_still_builds(short_run, tmp_path):
    run = tmp_path / "stripped"
    run.mkdir()
    keep = {"step", "version", "reward_mean"}
    rows = [json.loads(x) for x in (short_run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({k: v for k, v in r.items() if k in keep}) + "\n" for r in rows)
        + '{"step": 99, "reward_me'  # a torn last line, as after kill -9
    )
    report = build_report(run)
    assert "reward_by_step" in report.charts
    assert {"staleness", "time_split", "importance_weights"} <= set(report.skipped)
    assert report.html_path.is_file()


def test_report_errors_are_clear(tmp_path):
    with pytest.raises(RelayError, match="does not exist"):
        build_report(tmp_path / "nope")
    with pytest.raises(RelayError, match="neither metrics.jsonl nor samples.jsonl"):
        build_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(RelayError, match=r"metrics.jsonl:2: not valid JSON"):
        build_report(tmp_path)
