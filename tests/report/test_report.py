import html
import json
import re
from pathlib import Path

import pytest

from relayrl.cli import main
from relayrl.errors import RelayError
from relayrl.report.build import (
    ALPHA_PREFIXES,
    CHARTS,
    REPLAY_PREFIXES,
    TEXT_MISSING,
    build_report,
    prefixed_keys,
    render_samples,
    run_summary,
)
from relayrl.report.logs import load_run
from relayrl.train.run import run_train
from tests.train.conftest import parity_grader, rl_config

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DARL_CHARTS = {"replay", "darl_alpha"}
EPISODE_CHARTS = {"episodes"}  # multi-turn runs only


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, tiny_model_dir) -> Path:
    """A real 3-step asynchronous run (η = 1) of the tiny model, drift metrics on."""
    tmp = tmp_path_factory.mktemp("report_run")
    overrides = ("rollout.eta=1", "train.eval_every=2", "train.drift_metrics=true")
    run_train(rl_config(tmp, tiny_model_dir, *overrides), grader=parity_grader)
    return tmp / "run"


def test_report_from_a_real_run_has_every_chart(short_run, capsys):
    assert main(["report", str(short_run)]) == 0
    out = capsys.readouterr().out
    page = short_run / "report" / "index.html"
    assert str(page) in out
    text = page.read_text()
    for name in set(CHARTS) - DARL_CHARTS - EPISODE_CHARTS:  # no replay buffer, one turn
        png = short_run / "report" / f"{name}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC, name
        assert f"alt='{name}'" in text  # embedded: the page is self-contained
    for name in DARL_CHARTS | EPISODE_CHARTS:
        assert f"skipped chart {name}" in out
        assert not (short_run / "report" / f"{name}.png").exists()
    summary = run_summary(load_run(short_run))  # the last step and the final evaluation
    assert (summary["step"], summary["eval_version"], summary["eval_problems"]) == (3, 3, 4)
    assert "3 training steps logged, 24 trained samples" in text


def test_report_lists_best_and_worst_trajectories_with_text(short_run):
    text = "\n".join(render_samples(load_run(short_run)))
    samples = [json.loads(x) for x in (short_run / "samples.jsonl").read_text().splitlines()]
    assert "Best and worst sampled trajectories" in text
    assert [int(h) for h in re.findall(r"<h3>step (\d+)</h3>", text)] == [1, 2, 3]
    table = text.split("Best and worst sampled trajectories")[1]
    assert table.count("<td>best</td>") == table.count("<td>worst</td>") == 6  # 2 + 2 a step
    for step in range(3):
        rows = [s for s in samples if s["step"] == step]
        best = max(rows, key=lambda s: (s["reward"], s["advantage"]))
        assert html.escape(best["text"]) in table and html.escape(best["prompt_text"]) in table
    assert TEXT_MISSING not in text


def test_report_without_text_says_so(short_run, tmp_path):
    run = tmp_path / "no_text"
    run.mkdir()
    rows = [json.loads(x) for x in (short_run / "samples.jsonl").read_text().splitlines()]
    for row in rows:
        row.pop("text"), row.pop("prompt_text")
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = "\n".join(render_samples(load_run(run)))
    assert TEXT_MISSING in text and text.count("<td>best</td>") == 6


def darl_metrics(step: int) -> dict[str, float]:
    """The D-ARL metrics of one step, named as relayrl.train.replay_step logs them: keyed by
    lag (trainer version − behaviour version), lags 0 … 2."""
    row = {"replay_buffer_size": 40.0 + step, "replay_replayed": 8.0}
    for lag in range(3):
        row[f"replay_kept_fraction_v{lag}"] = 1.0 - 0.2 * lag
        row[f"replay_count_v{lag}"] = 16.0 - 4 * lag
        row[f"darl_ess_v{lag}"] = 10.0
        row[f"darl_alpha_v{lag}"] = 1 / 3
    return row


def test_report_draws_darl_metrics_by_prefix(short_run, tmp_path):
    """Replay / α_k metrics get charts by key prefix: fractions on the left axis, counts on
    the right; a chart per prefix group, whatever versions the keys name."""
    run = tmp_path / "darl"
    run.mkdir()
    rows = [json.loads(x) for x in (short_run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        if "reward_mean" in row:
            row.update(darl_metrics(row["step"]))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = build_report(run)
    assert DARL_CHARTS <= set(report.charts)
    text = report.html_path.read_text()
    for name in DARL_CHARTS:
        assert report.charts[name].read_bytes()[:8] == PNG_MAGIC
        assert f"alt='{name}'" in text
    replay_keys = prefixed_keys(load_run(run), REPLAY_PREFIXES)
    assert {f"replay_kept_fraction_v{lag}" for lag in range(3)} <= set(replay_keys)
    assert prefixed_keys(load_run(run), ALPHA_PREFIXES) == [f"darl_alpha_v{v}" for v in range(3)]


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
    assert {"staleness", "time_split", "importance_weights", "drift", "replay"} <= set(
        report.skipped
    )
    assert report.html_path.is_file()


def test_report_errors_are_clear(tmp_path):
    with pytest.raises(RelayError, match="does not exist"):
        build_report(tmp_path / "nope")
    with pytest.raises(RelayError, match="neither metrics.jsonl nor samples.jsonl"):
        build_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(RelayError, match=r"metrics.jsonl:2: not valid JSON"):
        build_report(tmp_path)


def test_a_real_run_records_tokens_for_the_inspector_and_the_mismatch_doctor(short_run):
    """inspect.jsonl: the first train.inspect_groups (4 ≥ B = 2: all) groups of each step,
    per token a version, a behaviour and a proximal logprob; metrics: per-staleness KL."""
    from relayrl.report.logs import read_jsonl

    rows = read_jsonl(short_run / "inspect.jsonl")
    samples = read_jsonl(short_run / "samples.jsonl")
    assert len(rows) == len(samples) == 3 * 2 * 4
    for row, sample in zip(rows, samples, strict=True):
        n = sample["completion_tokens"]
        assert (row["group_id"], row["sample_index"]) == (
            sample["group_id"],
            sample["sample_index"],
        )
        assert sum(count for _, count in row["versions"]) == len(row["behav"]) == n
        assert len(row["prox"]) == len(row["pieces"]) == n
        assert row["versions"][0][0] == sample["version_min"]
    steps = [m for m in load_run(short_run).metrics if "reward_mean" in m]
    assert all("completed_correct_frac" in m for m in steps)
    assert steps[0]["mismatch_kl_k3_s0"] < 1e-6  # fresh tokens: the engine is exact
    levels = {k for m in steps for k in m if k.startswith("mismatch_kl_k3_s")}
    assert levels <= {"mismatch_kl_k3_s0", "mismatch_kl_k3_s1"}  # η = 1
