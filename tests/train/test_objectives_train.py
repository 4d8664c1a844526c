"""The new objectives in a real (tiny) training run: GSPO with per-sequence token means and
REINFORCE++'s per-token advantages on stale batches (lag emulation, η = 2), and CISPO."""

from __future__ import annotations

import math

import pytest

from relayrl.report.logs import read_jsonl
from relayrl.train.run import run_train
from relayrl.train.run.recorded import load_recorded_steps
from tests.train.conftest import parity_grader, rl_config


@pytest.mark.parametrize(
    "overrides",
    [
        (
            "algo.loss=gspo",
            "algo.aggregation=seq_mean_token_mean",
            "algo.advantage=reinforce_pp",
            "algo.gamma=0.9",
            "algo.is_level=geometric",
        ),
        ("algo.loss=cispo", "algo.advantage=rloo"),
    ],
)
def test_objective_trains_on_stale_batches(tmp_path, tiny_model_dir, overrides):
    config = rl_config(
        tmp_path,
        tiny_model_dir,
        "rollout.lag=fixed",
        "rollout.eta=2",
        "optim.lr=1e-3",
        "train.dump_trajectories=true",
        *overrides,
    )
    run_train(config, grader=parity_grader)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    steps = [r for r in rows if "grad_norm" in r]
    assert len(steps) == 3
    assert all(math.isfinite(r["grad_norm"]) for r in steps)
    # a batch whose rewards are all equal has zero advantage everywhere (and no gradient)
    assert all(r["grad_norm"] > 0 for r in steps if 0 < r["reward_mean"] < 1)
    assert any(r["grad_norm"] > 0 for r in steps)
    assert max(r.get("staleness_max", 0) for r in steps) == 2
    trained = [t for step in load_recorded_steps(tmp_path / "run") for t in step.trajectories]
    per_token = "algo.advantage=reinforce_pp" in overrides
    assert all(bool(t.token_advantages) == per_token for t in trained)
