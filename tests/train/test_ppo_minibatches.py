"""PPO mini-batch updates (``optim.ppo_minibatches`` / ``ppo_epochs``): how the batch is cut,
that π_prox stays the policy the batch started from, and the weight-version bookkeeping."""

from __future__ import annotations

import torch

from relayrl.train.trainer import combine_update_stats, minibatch_slices
from tests.buffer.test_replay_training import make_trainer, params, synthetic_groups

torch.set_num_threads(1)


class _G(list):
    """A group stand-in: only its length matters to ``minibatch_slices``."""


def test_minibatch_slices_cut_whole_groups_and_deal_replays():
    groups = [_G([0, 0]), _G([0, 0, 0]), _G([0]), _G([0, 0])]  # trajectories 0..7
    assert minibatch_slices(groups, 8, 1) == [list(range(8))]
    assert minibatch_slices(groups, 8, 2) == [[0, 1, 2, 3, 4], [5, 6, 7]]
    assert minibatch_slices(groups, 8, 4) == [[0, 1], [2, 3, 4], [5], [6, 7]]
    # more mini-batches than groups: one group each, never an empty one
    assert minibatch_slices(groups[:2], 5, 3) == [[0, 1], [2, 3, 4]]
    # trajectories past the groups (replayed samples) are dealt round-robin
    assert minibatch_slices(groups[:2], 8, 2) == [[0, 1, 5, 7], [2, 3, 4, 6]]


def test_combine_update_stats_token_weighted():
    out = combine_update_stats(
        [
            ({"clip_frac": 0.5, "is_weight_max": 2.0, "grad_norm": 1.0}, 10),
            ({"clip_frac": 0.0, "is_weight_max": 3.0, "grad_norm": 3.0}, 30),
        ]
    )
    assert out == {"clip_frac": 0.125, "is_weight_max": 3.0, "grad_norm": 2.0}


def _set_behaviour_to_current_policy(trainer, groups) -> None:
    trajs = [t for g in groups for t in g]
    for t, lp in zip(trajs, trainer.traj_logprobs(trainer.model, trajs), strict=True):
        t.behav_logprobs = lp.tolist()


def test_minibatches_keep_prox_at_the_batch_start(tiny_model_dir):
    """With μ = the policy at the batch start, decoupled PPO (π_prox computed once, before the
    first mini-batch) and PPO against μ are the same update, mini-batch after mini-batch. Had
    π_prox been recomputed per mini-batch, the second AdamW step would differ."""
    knobs = ("optim.ppo_minibatches=2", "optim.lr=3e-2")
    decoupled = make_trainer(tiny_model_dir, *knobs)
    ppo = make_trainer(tiny_model_dir, *knobs, "algo.loss=ppo")
    groups = synthetic_groups(decoupled, seed=5, lags=[0, 1, 0, 2])
    _set_behaviour_to_current_policy(decoupled, groups)
    stats = decoupled.train_step(groups)
    ppo.train_step(groups)
    for a, b in zip(params(decoupled), params(ppo), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert stats["optimizer_steps"] == 2.0
    assert stats["clip_frac"] > 0  # the second step is clipped around π_prox

    # two one-step batches on the halves: π_prox is recomputed before the second
    recomputed = make_trainer(tiny_model_dir, knobs[1], "rollout.eta=3")
    recomputed.train_step(groups[:2])
    recomputed.train_step(groups[2:])
    gap = max(
        float((a - b).abs().max())
        for a, b in zip(params(recomputed), params(decoupled), strict=True)
    )
    assert gap > 1e-4


def test_minibatches_naive_equal_successive_steps(tiny_model_dir):
    """PPO against μ (no π_prox) with 2 mini-batches = two one-step batches on the halves
    (constant learning rate), except that the version advances once."""
    split = make_trainer(tiny_model_dir, "optim.ppo_minibatches=2", "algo.loss=ppo")
    steps = make_trainer(tiny_model_dir, "algo.loss=ppo", "rollout.eta=3")
    groups = synthetic_groups(split, seed=7, lags=[0, 1, 2, 0])
    split.train_step(groups)
    steps.train_step(groups[:2])
    steps.train_step(groups[2:])
    for a, b in zip(params(split), params(steps), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (split.version, steps.version) == (1, 2)


def test_epochs_multiply_optimizer_steps(tiny_model_dir):
    trainer = make_trainer(tiny_model_dir, "optim.ppo_minibatches=2", "optim.ppo_epochs=3")
    groups = synthetic_groups(trainer, seed=9, lags=[0, 0, 1])
    before = params(trainer)
    stats = trainer.train_step(groups)
    assert stats["optimizer_steps"] == 6.0
    assert trainer.version == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, params(trainer), strict=True))


def test_fused_prox_equals_the_separate_pass(tiny_model_dir):
    """One AdamW step over the whole batch takes π_prox from its own forward pass; the
    update, the behaviour weights and the engine-vs-trainer statistics equal those of the
    separate no-grad pass (forced here), which the step then no longer runs."""
    knobs = ("optim.lr=3e-2", "rollout.eta=3", "algo.is_level=token", "algo.is_cap=1.5")
    fused = make_trainer(tiny_model_dir, *knobs)
    separate = make_trainer(tiny_model_dir, *knobs)
    separate._fuses_prox = lambda parts: False
    groups = synthetic_groups(fused, seed=11, lags=[0, 1, 3, 2])
    calls = []
    real_pass = fused.traj_logprobs
    fused.traj_logprobs = lambda *a, **k: calls.append(1) or real_pass(*a, **k)
    got, want = fused.train_step(groups), separate.train_step(groups)
    assert calls == []  # no proximal pass
    for a, b in zip(params(fused), params(separate), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    stats = ("is_weight_mean", "is_weight_max", "ess_frac", "engine_trainer_kl_k3", "behav_kl_k3")
    for key in stats:
        assert key in want, key
        assert abs(got[key] - want[key]) <= 1e-6 * max(1.0, abs(want[key])), key
    assert want["is_weight_max"] > 1.0  # the stale tokens carry behaviour weights ≠ 1
    # several mini-batches need π_prox fixed across AdamW steps: the separate pass stays
    split = make_trainer(tiny_model_dir, *knobs, "optim.ppo_minibatches=2")
    assert not split._fuses_prox([[0], [1]])
    assert not make_trainer(tiny_model_dir, *knobs, "optim.ppo_epochs=2")._fuses_prox([[0]])
    assert not make_trainer(tiny_model_dir, "algo.loss=ppo")._fuses_prox([[0]])
