"""REINFORCE++ (no baseline): discounted token returns whitened over the batch, against
hand-computed values, and how per-token advantages reach the loss."""

from __future__ import annotations

import statistics

import pytest
import torch

from relayrl.algo.advantages import compute_advantages, compute_token_advantages
from relayrl.rollout.controller import assign_advantages
from relayrl.rollout.trajectory import ORIGIN_ENV, ORIGIN_MODEL, Trajectory

torch.set_num_threads(1)

REWARDS = [[1.0, 0.0], [1.0]]
# sample (1, 0) is a two-turn episode: model, environment, model
MASKS = [[[True, True, True], [True, True]], [[True, False, True]]]


def test_reinforce_pp_discounted_returns_whitened_over_trained_tokens() -> None:
    out = compute_token_advantages(REWARDS, MASKS, "reinforce_pp", gamma=0.5)
    # G_t = γ^(trained tokens after t)·R: [.25, .5, 1], [0, 0], [.5, (env), 1]
    returns = [0.25, 0.5, 1.0, 0.0, 0.0, 0.5, 1.0]
    m, s = sum(returns) / 7, statistics.stdev(returns)
    assert m == pytest.approx(13 / 28)

    def w(g: float) -> float:
        return (g - m) / (s + 1e-6)

    expected = [[[w(0.25), w(0.5), w(1.0)], [w(0.0), w(0.0)]], [[w(0.5), 0.0, w(1.0)]]]
    for got_g, exp_g in zip(out, expected, strict=True):
        for got, exp in zip(got_g, exp_g, strict=True):
            assert got == pytest.approx(exp)


def test_reinforce_pp_undiscounted_is_a_token_weighted_batch_whitening() -> None:
    out = compute_token_advantages(REWARDS, MASKS, "reinforce_pp", gamma=1.0)
    values = [1.0] * 3 + [0.0] * 2 + [1.0] * 2  # one value per trained token
    m, s = sum(values) / 7, statistics.stdev(values)
    assert out[0][0] == pytest.approx([(1 - m) / (s + 1e-6)] * 3)
    assert out[0][1] == pytest.approx([(0 - m) / (s + 1e-6)] * 2)
    assert out[1][0][1] == 0.0  # the environment token


def test_reinforce_pp_needs_token_masks_and_others_broadcast() -> None:
    with pytest.raises(ValueError, match="per-token"):
        compute_advantages(REWARDS, "reinforce_pp")
    grpo = compute_token_advantages([[1.0, 0.0]], [[[True, True], [True, False]]], "grpo")
    a = compute_advantages([[1.0, 0.0]], "grpo")[0]
    assert grpo == [[[a[0], a[0]], [a[1], 0.0]]]


def _traj(i: int, reward: float, n: int, origins: list[int] | None = None) -> Trajectory:
    return Trajectory(
        "p", "g", i, [5, 6], [7] * n, [-1.0] * n, [0] * n, 0, "stop", reward,
        origins=origins or [],
    )  # fmt: skip


def test_assign_advantages_sets_token_advantages_and_their_mean() -> None:
    episode = [ORIGIN_MODEL, ORIGIN_ENV, ORIGIN_MODEL]
    groups = [[_traj(0, 1.0, 3), _traj(1, 0.0, 2)], [_traj(0, 1.0, 3, episode)]]
    assign_advantages(groups, "reinforce_pp", gamma=0.5)
    expected = compute_token_advantages(REWARDS, MASKS, "reinforce_pp", gamma=0.5)
    assert [[t.token_advantages for t in g] for g in groups] == expected
    ep = groups[1][0]
    assert ep.advantage == pytest.approx(sum(ep.token_advantages) / 2)  # 2 model tokens
    # a per-sample estimator leaves token_advantages empty
    plain = [[_traj(0, 1.0, 3), _traj(1, 0.0, 2)]]
    assign_advantages(plain, "grpo")
    assert plain[0][0].token_advantages == [] and plain[0][0].advantage > 0


def test_trainer_batches_carry_token_advantages() -> None:
    from relayrl.train.trainer import _collate

    t = _traj(0, 1.0, 3)
    t.token_advantages = [0.5, -1.0, 2.0]
    u = _traj(1, 0.0, 2)
    u.advantage = -0.25
    mb = _collate([t, u], [0, 1], pad_id=0, device=torch.device("cpu"))
    assert mb.gather(mb.adv)[0].tolist() == [0.5, -1.0, 2.0]
    assert mb.gather(mb.adv)[1].tolist() == [-0.25, -0.25]
    with pytest.raises(ValueError, match="token advantages"):
        Trajectory("p", "g", 0, [1], [2, 3], [0.0, 0.0], [0, 0], 0, token_advantages=[1.0])
