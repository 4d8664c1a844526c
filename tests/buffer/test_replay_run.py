"""The D-ARL preset through the whole asynchronous job (rollout server, controller, grading,
trainer with replay): per-lag metrics in metrics.jsonl, bounded keys, staleness bounds."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from relayrl.report.logs import read_jsonl
from relayrl.train.run import run_train
from tests.train.conftest import parity_grader, rl_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def preset_overrides(name: str) -> list[str]:
    """A preset file as dotted KEY=VALUE overrides (its run name left out)."""

    def walk(node: dict, prefix: str) -> list[str]:
        out = []
        for key, value in node.items():
            if isinstance(value, dict):
                out += walk(value, f"{prefix}{key}.")
            elif prefix or key != "name":
                out.append(f"{prefix}{key}={json.dumps(value)}")
        return out

    return walk(yaml.safe_load((CONFIGS / name).read_text()), "")


def test_darl_preset_end_to_end(tmp_path, tiny_model_dir):
    overrides = preset_overrides("darl.yaml")
    assert "replay.enable=true" in overrides and "replay.k=8" in overrides
    config = rl_config(
        tmp_path,
        tiny_model_dir,
        *overrides,
        "rollout.eta=2",
        "replay.warmup=1",
        "replay.quantile=1.0",
        "train.total_steps=4",
        "optim.lr=1e-3",
    )
    run_train(config, grader=parity_grader)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    steps = [r for r in rows if "train_tokens" in r]
    assert len(steps) == 4
    fresh = config.rollout.prompts_per_step * config.rollout.n_samples
    for r in steps:
        assert r["replay_fresh"] == fresh and r["staleness_max"] <= 2
        counts = {k: v for k, v in r.items() if k.startswith("replay_count_v")}
        assert sum(counts.values()) == fresh + r["replay_replayed"]
        lags = [
            int(k.rsplit("v", 1)[1]) for k in r if k.startswith(("replay_", "darl_")) and "_v" in k
        ]
        assert max(lags) <= max(config.rollout.eta, config.replay.k - 1)
        alphas = [v for k, v in r.items() if k.startswith("darl_alpha_v")]
        assert abs(sum(alphas) - 1.0) < 1e-9
    assert steps[0]["replay_candidates"] == 0  # warm-up: fresh only
    assert all(r["replay_candidates"] > 0 for r in steps[1:])
    assert all(any(k.startswith("replay_kept_fraction_v") for k in r) for r in steps[1:])
    # quantile 1.0 of the fresh scores: replayed samples as off-policy as the stalest fresh
    # one are kept, up to batch_fraction · fresh per step
    assert sum(r["replay_replayed"] for r in steps) > 0
    assert all(r["replay_replayed"] <= 0.5 * fresh for r in steps)
