"""Train-only replay (`relayrl train --replay-from RUN_DIR`): the recorded run's updates, bit
for bit, from the recorded rewards and advantages, without a rollout server or a grader."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from relayrl.cli import main
from relayrl.errors import RelayError
from relayrl.models.loading import load_model
from relayrl.report.logs import read_jsonl
from relayrl.train.run.recorded import (
    check_staleness,
    load_recorded_steps,
    replay_config,
    run_replay,
)
from tests.train.conftest import RECORDED_OVERRIDES, rl_config

SAME_STEP_KEYS = ("reward_mean", "staleness_max", "is_weight_mean", "ess_frac", "grad_norm", "lr")


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in load_model(model_dir).named_parameters()}


@pytest.fixture
def no_server_no_grader(monkeypatch):
    """Starting a rollout server or a grading pool fails the test."""

    def forbidden(*args, **kwargs):
        raise AssertionError("replay must not start rollout servers or grading processes")

    monkeypatch.setattr("relayrl.launch.servers.ServerLauncher.start", forbidden)
    monkeypatch.setattr("relayrl.rewards.pool.GradingPool.__init__", forbidden)


def copy_run(run: Path, dest: Path, edit_sample=None) -> Path:
    """A copy of a run's logs and config, with ``edit_sample(row)`` applied to each sample."""
    dest.mkdir(parents=True)
    for name in ("metrics.jsonl", "config.yaml"):
        shutil.copy(run / name, dest / name)
    rows = read_jsonl(run / "samples.jsonl")
    for row in rows:
        if edit_sample is not None:
            edit_sample(row)
    (dest / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return dest


def test_replay_reproduces_the_recorded_run_bitwise(
    recorded_run, tiny_model_dir, no_server_no_grader, capsys
):
    """The recorded run's own config through the CLI: every update, hence the first, equal."""
    config = str(recorded_run / "config.yaml")
    assert main(["train", "--replay-from", str(recorded_run), config]) == 0
    replay = recorded_run.parent / "run-replay"  # the recorded run dir is never overwritten
    assert f"run directory: {replay}" in capsys.readouterr().out

    got, want = weights(replay / "final_model"), weights(recorded_run / "final_model")
    base = weights(tiny_model_dir)
    assert max((want[n] - base[n]).abs().max().item() for n in base) > 1e-5  # it trained
    different = [n for n in want if not torch.equal(got[n], want[n])]
    assert not different, f"replayed weights differ from the recorded run's: {different}"

    recorded, replayed = (
        [r for r in read_jsonl(run / "metrics.jsonl") if "reward_mean" in r]
        for run in (recorded_run, replay)
    )
    assert len(recorded) == len(replayed) == 3
    for a, b in zip(recorded, replayed, strict=True):
        assert {k: a[k] for k in SAME_STEP_KEYS} == {k: b[k] for k in SAME_STEP_KEYS}
    samples = [
        [(r["group_id"], r["reward"], r["advantage"]) for r in read_jsonl(run / "samples.jsonl")]
        for run in (recorded_run, replay)
    ]
    assert samples[0] == samples[1]


def test_replay_uses_the_recorded_advantages(recorded_run, tiny_model_dir, tmp_path):
    """Negating the recorded advantages negates the first update: nothing is re-graded."""

    def negate(row):
        row["trajectory"]["advantage"] = -row["trajectory"]["advantage"]

    source = copy_run(recorded_run, tmp_path / "negated_source", negate)
    updates = []
    for name, src in (("plain", recorded_run), ("negated", source)):
        cfg = rl_config(tmp_path, tiny_model_dir, *RECORDED_OVERRIDES, f"name={name}")
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"total_steps": 1})})
        run_replay(cfg, src)
        updates.append(weights(tmp_path / name / "final_model"))
    base = weights(tiny_model_dir)
    plain = {n: updates[0][n] - base[n] for n in base}
    negated = {n: updates[1][n] - base[n] for n in base}
    assert max(d.abs().max().item() for d in plain.values()) > 1e-5
    worst = max((plain[n] + negated[n]).abs().max().item() for n in base)
    assert worst < 1e-7, f"negated advantages did not negate the update ({worst})"


def test_replay_refuses_a_run_recorded_without_trajectories(recorded_run, tmp_path):
    source = copy_run(recorded_run, tmp_path / "plain", lambda row: row.pop("trajectory"))
    with pytest.raises(RelayError, match=r"samples.jsonl:1: .*dump_trajectories=true"):
        load_recorded_steps(source)


def test_replay_drops_an_incomplete_last_step(recorded_run, tmp_path):
    source = copy_run(recorded_run, tmp_path / "killed")
    rows = read_jsonl(source / "metrics.jsonl")[:2]  # as if killed before step 3's row
    (source / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    steps = load_recorded_steps(source)
    assert [s.step for s in steps] == [0, 1]
    assert all(len(s.groups) == 2 and len(s.trajectories) == 8 for s in steps)  # B=2, n=4


def test_replay_checks_staleness_and_weights(recorded_run, tmp_path):
    steps = load_recorded_steps(recorded_run)
    for t in steps[2].trajectories:
        t.versions = [0] * len(t.versions)  # staleness 2 at step 3
    with pytest.raises(RelayError, match=r"step 3 .*staleness 2.*rollout.eta=2"):
        check_staleness(steps, eta=1)
    config = rl_config(tmp_path, "unused").model_copy(
        update={"model": rl_config(tmp_path, "x").model.model_copy(update={"path": None})}
    )
    with pytest.raises(RelayError, match="set model.path"):
        replay_config(config, tmp_path)
