"""Small pieces of the training loop checked against hand-computed values: the learning-rate
schedules, the effective-sample-size statistic and the clean-up of published snapshots."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.sync.transaction import remove_older_snapshots
from relayrl.train.trainer import lr_factor
from tests.buffer.test_replay_training import make_trainer, synthetic_groups


@pytest.mark.parametrize(
    ("step", "schedule", "expected"),
    [
        (0, "constant", 0.25),  # warm-up: (step + 1) / warmup
        (3, "cosine", 1.0),  # warm-up ends at the peak
        (4, "cosine", 1.0),  # progress 0
        (9, "cosine", 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 10))),  # 0.55
        (14, "cosine", 0.1),  # the end: a floor of 10 % of the peak
        (30, "cosine", 0.1),  # past the end stays at the floor
        (9, "linear", 1.0 - 0.9 * 0.5),
        (14, "linear", 0.1),
        (9, "constant", 1.0),
    ],
)
def test_lr_schedules(step, schedule, expected):
    assert lr_factor(step, warmup=4, total=14, schedule=schedule) == pytest.approx(expected)


def test_ess_frac_is_the_normalised_effective_sample_size(tiny_model_dir):
    """Half the tokens with w = π_prox/μ = 2, half with w = 1: ESS/N = (Σw)²/(N·Σw²) =
    (1.5N)²/(N·2.5N) = 0.9."""
    trainer = make_trainer(tiny_model_dir, "rollout.eta=0")
    groups = synthetic_groups(trainer, seed=0, lags=[0, 0], n=2)
    trajs = [t for g in groups for t in g]
    for t in trajs:
        even = 2 * (len(t.completion_ids) // 2)
        t.completion_ids, t.behav_logprobs = t.completion_ids[:even], t.behav_logprobs[:even]
        t.versions = [trainer.version] * even
    prox = trainer.traj_logprobs(trainer.model, trajs)
    for t, lp in zip(trajs, prox, strict=True):
        halve = torch.tensor([math.log(2.0) if i % 2 == 0 else 0.0 for i in range(len(lp))])
        t.behav_logprobs = (lp - halve).tolist()
    stats = trainer.train_step(groups)
    assert stats["ess_frac"] == pytest.approx(0.9, abs=1e-5)
    assert stats["is_weight_mean"] == pytest.approx(1.5, abs=1e-5)


def test_only_older_snapshots_are_removed(tmp_path):
    for name in ("v1", "v2", "v3", "v10", "vx", "notes"):
        (tmp_path / name).mkdir()
    (tmp_path / "v0").write_text("a file, not a snapshot")
    removed = remove_older_snapshots(tmp_path, 3)
    assert [p.name for p in removed] == ["v1", "v2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "v0", "v10", "v3", "vx"]


@pytest.mark.parametrize(
    ("loss", "minibatches"), [("ppo", 1), ("ppo", 2), ("decoupled", 1), ("recompute", 1)]
)
def test_drift_metrics_equal_separate_passes_before_and_after(tiny_model_dir, loss, minibatches):
    """``drift_kl_k3`` and ``behav_prox_kl_k3`` are the k3 means of two plain no-grad passes
    around the step, for every loss; in one AdamW step every loss takes π_v (and π_prox) from
    the update's own forward (one pass fewer), otherwise the trainer runs the pass it needs."""
    from relayrl.algo.losses import policy_drift

    trainer = make_trainer(
        tiny_model_dir,
        f"algo.loss={loss}",
        f"optim.ppo_minibatches={minibatches}",
        "train.drift_metrics=true",
    )
    groups = synthetic_groups(trainer, seed=5, lags=[0, 1])
    trajs = [t for g in groups for t in g]
    before = trainer.traj_logprobs(trainer.model, trajs)
    passes = []
    recompute = trainer.traj_logprobs

    def counted(*args, **kwargs):  # the trainer's own recompute, counted
        passes.append(1)
        return recompute(*args, **kwargs)

    trainer.traj_logprobs = counted
    stats = trainer.train_step(groups)
    after = recompute(trainer.model, trajs)
    expected = policy_drift(
        [t.behav_logprobs for t in trajs], [t.model_mask for t in trajs], before, after
    )
    assert stats["drift_kl_k3"] > 1e-6  # the step moved the policy
    assert stats["drift_kl_k3"] == pytest.approx(expected["drift_kl_k3"], rel=1e-5)
    assert stats["behav_prox_kl_k3"] == pytest.approx(expected["behav_prox_kl_k3"], rel=1e-5)
    assert len(passes) == (1 if minibatches == 1 else 2)
