"""``rollout.eta=auto`` in runs: lag emulation follows the rule's η sequence deterministically,
and a live run moves its admission bound per step within [1, rollout.eta_max] without ever
training a sample staler than the bound its group was admitted under."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.metric_names import (
    ETA,
    LAG,
    STALE_KL_PER_VERSION,
    STALENESS_MAX,
    STALENESS_SLACK,
    TRAIN_TOKENS,
)
from relayrl.rollout.eta import DEFAULT_ETA_BUDGET
from relayrl.train.run import run_train
from tests.train.conftest import parity_grader, rl_config
from tests.train.test_lag import _max_diff, _weights


def _steps(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if TRAIN_TOKENS in r]


def test_lag_emulation_with_auto_is_deterministic_and_follows_the_rule(tmp_path, tiny_model_dir):
    """At lr 1e-4 the tiny model's per-version drift is far below the budget, so the rule
    grows η by one per step from 1 once a stale batch was measured (the first batch, at
    version 0, has none): η = 1, 2, 3, 3, 3 (η_max 3) and the batch at version v has lag
    min(η chosen after the step before, v). The same seed twice gives the same η sequence
    and bitwise the same weights. At lr 1e-3 (high drift: k ≈ 4e-3–1e-2, above half the
    default budget 2e-3) η stays 1."""
    runs = {}
    for name, lr in (("a", "1e-4"), ("b", "1e-4"), ("c", "1e-3")):
        config = rl_config(
            tmp_path,
            tiny_model_dir,
            f"name={name}",
            "rollout.lag=fixed",
            "rollout.eta=auto",
            "rollout.eta_max=3",
            "train.total_steps=5",
            f"optim.lr={lr}",
        )
        run_train(config, grader=parity_grader)
        runs[name] = _steps(tmp_path / name)
    etas = [r[ETA] for r in runs["a"]]
    assert etas == [1.0, 2.0, 3.0, 3.0, 3.0]
    assert [r[LAG] for r in runs["a"]] == [0.0, 1.0, 2.0, 3.0, 3.0]
    assert [r[ETA] for r in runs["b"]] == etas
    assert [r[STALE_KL_PER_VERSION] for r in runs["b"][1:]] == [
        r[STALE_KL_PER_VERSION] for r in runs["a"][1:]
    ]
    assert STALE_KL_PER_VERSION not in runs["a"][0]  # version 0: nothing stale to measure
    assert (
        _max_diff(
            _weights(tmp_path / "a" / "final_model"), _weights(tmp_path / "b" / "final_model")
        )
        == 0.0
    )
    assert [r[ETA] for r in runs["c"]] == [1.0] * 5
    assert all(r[STALE_KL_PER_VERSION] > DEFAULT_ETA_BUDGET / 2 for r in runs["c"][1:])


def test_live_run_with_auto_keeps_every_sample_within_its_admission_bound(tmp_path, tiny_model_dir):
    config = rl_config(
        tmp_path, tiny_model_dir, "rollout.eta=auto", "rollout.eta_max=3", "train.total_steps=5"
    )
    run_train(config, grader=parity_grader)
    steps = _steps(tmp_path / "run")
    assert len(steps) == 5
    for row in steps:
        assert 1.0 <= row[ETA] <= 3.0
        assert row[STALENESS_SLACK] >= 0  # staleness ≤ the bound in force at admission
        assert row[STALENESS_MAX] <= 3.0
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert all(0 <= s["step"] - s["version_min"] <= 3 for s in samples)


def test_auto_eta_state_is_checkpointed_and_resumed(tmp_path, tiny_model_dir, monkeypatch):
    """The rule's state (η, k̂, r̂) is part of a checkpoint; the resumed run goes on from it
    (its next bound moves at most one up from the checkpointed one)."""
    from tests.train.test_resume import crash_on_call, rows

    config = rl_config(
        tmp_path,
        tiny_model_dir,
        "rollout.eta=auto",
        "rollout.eta_max=3",
        "train.total_steps=4",
        "train.checkpoint_every=2",
    )
    crash_on_call(monkeypatch, 4)
    with pytest.raises(RuntimeError, match="injected crash"):
        run_train(config, grader=parity_grader)
    monkeypatch.undo()
    run_dir = tmp_path / "run"
    (saved,) = [json.loads(p.read_text()) for p in run_dir.rglob("auto_eta.json")]
    second = _steps(run_dir)[1]
    assert saved["eta"] == second[ETA] and saved["drift"] == second.get("eta_drift")
    run_train(config, grader=parity_grader, resume=True)
    steps = [r for r in rows(run_dir / "metrics.jsonl") if TRAIN_TOKENS in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert 1.0 <= steps[2][ETA] <= min(saved["eta"] + 1, 3)
