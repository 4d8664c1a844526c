"""D-ARL in the trainer step: reduction to decoupled PPO, selection, replay bookkeeping,
micro-batch invariance of the multi-behaviour loss, balance-heuristic weights."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from relayrl.config.loader import load_config
from relayrl.errors import RelayError
from relayrl.models.loading import load_model, load_tokenizer
from relayrl.rollout.trajectory import Trajectory
from relayrl.train.options import TrainerOptions
from relayrl.train.replay_step import ReplayStep, trajectory_scores
from relayrl.train.trainer import RLTrainer

torch.set_num_threads(1)

BASE = [
    "model.max_context=64",
    "rollout.eta=2",
    "optim.lr=1e-3",
    "optim.warmup_steps=0",
    "algo.loss=decoupled",
]


def make_trainer(model_dir, *overrides: str) -> RLTrainer:
    config = load_config(None, BASE + list(overrides))
    torch.manual_seed(0)
    return RLTrainer(
        load_model(model_dir),
        TrainerOptions.from_config(config),
        pad_id=load_tokenizer(model_dir).pad_token_id,
    )


def synthetic_groups(
    trainer: RLTrainer, seed: int, lags: list[int], n: int = 3
) -> list[list[Trajectory]]:
    """One group per entry of ``lags``: random prompts and completions whose tokens were
    'produced' by version ``trainer.version − lag`` (the last group's second sample is
    interrupted: its tail comes from one version later); behaviour logprobs are the current
    model's plus noise, so π_prox/μ ≠ 1."""
    g = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    groups = []
    for gi, lag in enumerate(lags):
        group = []
        for j in range(n):
            c = int(torch.randint(3, 9, (1,), generator=g))
            prompt = torch.randint(
                3, vocab, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g
            )
            version = trainer.version - lag
            versions = [version] * c
            if gi == len(lags) - 1 and j == 1 and lag > 0:
                versions[c // 2 :] = [version + 1] * (c - c // 2)
            group.append(
                Trajectory(
                    prompt_id=f"p{seed}-{gi}",
                    group_id=f"g{seed}-{gi}",
                    sample_index=j,
                    prompt_ids=prompt.tolist(),
                    completion_ids=torch.randint(3, vocab, (c,), generator=g).tolist(),
                    behav_logprobs=[0.0] * c,
                    versions=versions,
                    submit_version=version,
                    reward=float(j % 2),
                    advantage=float(torch.randn(1, generator=g)),
                )
            )
        groups.append(group)
    trajs = [t for grp in groups for t in grp]
    for t, lp in zip(trajs, trainer.traj_logprobs(trainer.model, trajs), strict=True):
        noise = 0.3 * torch.randn(lp.shape, generator=g)
        t.behav_logprobs = (lp + noise).clamp(max=-1e-3).tolist()
    return groups


def params(trainer: RLTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def record_grads(trainer: RLTrainer) -> list[list[torch.Tensor]]:
    """Capture the (clipped) gradients each time the optimizer steps."""
    seen: list[list[torch.Tensor]] = []
    step = trainer.optimizer.step

    def wrapped(*args, **kwargs):
        seen.append([p.grad.detach().clone() for p in trainer.model.parameters()])
        return step(*args, **kwargs)

    trainer.optimizer.step = wrapped
    return seen


# ------------------------------------------------------------------ exact reduction


@pytest.mark.parametrize("minibatches", [1, 2])
def test_k1_no_selection_uniform_equals_decoupled_ppo_in_the_trainer(tiny_model_dir, minibatches):
    """replay on with K = 1, select=none, weighting=uniform: bitwise the plain decoupled step,
    over steps whose fresh samples span several behaviour versions (lags 0..2). With PPO
    mini-batches the multi-behaviour loss's batch normaliser is shared out by token counts,
    which equals the plain per-mini-batch token mean up to rounding."""
    knob = f"optim.ppo_minibatches={minibatches}"
    plain = make_trainer(tiny_model_dir, knob)
    darl = make_trainer(
        tiny_model_dir,
        knob,
        "replay.enable=true",
        "replay.k=1",
        "replay.select=none",
        "replay.weighting=uniform",
        "replay.warmup=0",
        "replay.max_reuse=3",
    )
    for step in range(3):
        groups = synthetic_groups(plain, seed=step, lags=[2, 1, 0])
        a = plain.train_step(groups)
        b = darl.train_step(copy.deepcopy(groups))
        assert b["replay_replayed"] == 0 and b["replay_fresh"] == 9
        assert sum(b[f"darl_alpha_v{lag}"] for lag in range(3)) == pytest.approx(1.0)
        assert a["clip_frac"] == pytest.approx(b["clip_frac"])
        for p, q in zip(params(plain), params(darl), strict=True):
            if minibatches == 1:
                assert torch.equal(p, q)
            else:
                torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    assert len(darl.replay.buffer) == 0  # K = 1: every trained sample leaves at once


# ------------------------------------------------------------------ selection


def traj_with_score(group: str, version: int, w: list[float]) -> tuple[Trajectory, torch.Tensor]:
    """A trajectory whose per-token π_prox/μ is ``w`` (μ = 0.5 per token)."""
    behav = [math.log(0.5)] * len(w)
    t = Trajectory(
        prompt_id=group,
        group_id=group,
        sample_index=0,
        prompt_ids=[1, 2],
        completion_ids=[5] * len(w),
        behav_logprobs=behav,
        versions=[version] * len(w),
        submit_version=version,
    )
    return t, torch.tensor([math.log(0.5 * x) for x in w])


def test_selection_quantile_of_fresh_scores_and_cap():
    config = load_config(None, ["replay.quantile=0.5", "replay.batch_fraction=0.5"])
    step = ReplayStep(config.replay, eta=2, model=torch.nn.Linear(1, 1))
    # fresh (version 10, trainer version 10): scores 0, 0.01, 0.04, 0.09 -> median 0.025
    fresh = [traj_with_score(f"f{i}", 10, [1 + 0.1 * i, 1 - 0.1 * i]) for i in range(4)]
    # replayed: lag 1 scores 0.01 and 0.09; lag 3 score 0.0025 and 0.04
    replay = [
        traj_with_score("r0", 9, [1.1, 0.9]),
        traj_with_score("r1", 9, [1.3, 0.7]),
        traj_with_score("r2", 7, [1.05, 0.95]),
        traj_with_score("r3", 7, [1.2, 0.8]),
    ]
    cands = [t for t, _ in fresh + replay]
    prox = [p for _, p in fresh + replay]
    scores = trajectory_scores(cands, prox)
    assert scores == pytest.approx([0, 0.01, 0.04, 0.09, 0.01, 0.09, 0.0025, 0.04])
    batch = step.select(cands, prox, n_fresh=4, version=10)
    # kept: r0 (0.01) and r2 (0.0025); cap = 0.5 * 4 = 2; lowest score first
    assert [t.group_id for t in batch.trajs] == ["f0", "f1", "f2", "f3", "r2", "r0"]
    s = batch.stats
    assert s["replay_cutoff"] == pytest.approx(0.025)
    assert s["replay_kept_fraction_v1"] == 0.5 and s["replay_kept_fraction_v3"] == 0.5
    assert s["replay_score_v1"] == pytest.approx(0.05)
    assert s["replay_count_v0"] == 4 and s["replay_count_v1"] == 1 and s["replay_count_v3"] == 1
    assert s["replay_candidates"] == 4 and s["replay_replayed"] == 2

    tight = ReplayStep(
        config.replay.model_copy(update={"batch_fraction": 0.25}), 2, torch.nn.Linear(1, 1)
    )
    assert [t.group_id for t in tight.select(cands, prox, 4, 10).replayed] == ["r2"]
    none = ReplayStep(
        config.replay.model_copy(update={"select": "none", "batch_fraction": 1.0}),
        2,
        torch.nn.Linear(1, 1),
    )
    # no selection: every candidate kept, newest behaviour version first
    assert [t.group_id for t in none.select(cands, prox, 4, 10).replayed] == [
        "r0",
        "r1",
        "r2",
        "r3",
    ]


# ------------------------------------------------------------------ replay in the trainer


def test_replay_warmup_reuse_window_and_microbatch_invariance(tiny_model_dir):
    trainer = make_trainer(
        tiny_model_dir,
        "replay.enable=true",
        "replay.k=2",
        "replay.warmup=1",
        "replay.max_reuse=2",
        "replay.batch_fraction=1.0",
        "replay.quantile=1.0",
    )
    first = synthetic_groups(trainer, seed=0, lags=[0, 0])
    s0 = trainer.train_step(first)
    assert s0["replay_replayed"] == 0 and s0["replay_candidates"] == 0  # warm-up
    assert all(t.times_trained == 1 for g in first for t in g)
    assert len(trainer.replay.buffer) == 6

    second = synthetic_groups(trainer, seed=1, lags=[1, 0])
    # same step with one sequence per micro-batch: the gradient must not change
    other = copy.deepcopy(trainer)
    other.options = dataclasses.replace(other.options, micro_batch_tokens=1)  # one each
    grads_a, grads_b = record_grads(trainer), record_grads(other)
    s1 = trainer.train_step(second)
    s1b = other.train_step(copy.deepcopy(second))
    assert s1["micro_batches"] == 1
    assert s1b["micro_batches"] == 6 + s1["replay_replayed"]
    assert s1["replay_candidates"] == 6 and 0 < s1["replay_replayed"] <= 6
    assert s1["replay_replayed"] == s1b["replay_replayed"]
    assert s1["replay_count_v1"] == 3 + s1["replay_replayed"]  # fresh lag 1 + replayed
    alphas = {k: v for k, v in s1.items() if k.startswith("darl_alpha_v")}
    assert set(alphas) == {"darl_alpha_v0", "darl_alpha_v1"}
    assert sum(alphas.values()) == pytest.approx(1.0)
    assert s1["darl_ess_v1"] <= s1["replay_count_v1"] * 8  # ≤ its token count
    for ga, gb in zip(grads_a[0], grads_b[0], strict=True):
        torch.testing.assert_close(ga, gb, atol=2e-6, rtol=1e-4)

    # replayed samples reached max_reuse = 2 and left; version 0 is outside K = 2 at v = 2
    stored = list(trainer.replay.buffer)
    assert all(t.times_trained == 1 and t.oldest_version >= 1 for t in stored)
    third = synthetic_groups(trainer, seed=2, lags=[0])
    s2 = trainer.train_step(third)
    assert s2["replay_candidates"] == len(stored)
    assert max(int(k.rsplit("v", 1)[1]) for k in s2 if k.startswith("replay_count_v")) <= 1


def test_replay_state_dict_round_trip(tiny_model_dir):
    trainer = make_trainer(tiny_model_dir, "replay.enable=true", "replay.warmup=0")
    trainer.train_step(synthetic_groups(trainer, seed=0, lags=[0, 0]))
    state = trainer.state_dict()
    fresh = make_trainer(tiny_model_dir, "replay.enable=true", "replay.warmup=0")
    fresh.load_state_dict(state)
    assert [t.to_dict() for t in fresh.replay.buffer] == [
        t.to_dict() for t in trainer.replay.buffer
    ]
    assert fresh.version == 1


# ------------------------------------------------------------------ balance heuristic


def test_balance_weights_from_stored_versions(tiny_model_dir):
    """log w_t = log π_prox − log Σ_j (n_j/N) μ_j: μ_j from the engine for the token's own
    version, from the stored weights of version j otherwise; checked against copies of the
    model kept by the test after each step."""
    trainer = make_trainer(
        tiny_model_dir,
        "replay.enable=true",
        "replay.weighting=balance",
        "replay.k=3",
        "replay.warmup=0",
        "replay.select=none",
        "replay.batch_fraction=1.0",
    )
    models = {0: copy.deepcopy(trainer.model)}
    for step in range(2):
        trainer.train_step(synthetic_groups(trainer, seed=step, lags=[step, 0]))
        models[trainer.version] = copy.deepcopy(trainer.model)
    assert trainer.replay.snapshots.versions == [0, 1, 2]
    fresh = [t for g in synthetic_groups(trainer, seed=5, lags=[2, 1, 0]) for t in g]
    batch, terms = trainer._replay_batch(fresh)
    assert batch.replayed  # versions 0..2 all present
    trajs = batch.trajs
    behav = torch.tensor([x for t in trajs for x in t.behav_logprobs], dtype=torch.float64)
    ver = torch.tensor([v for t in trajs for v in t.versions])
    under = {j: torch.cat(trainer.traj_logprobs(m, trajs)).double() for j, m in models.items()}
    present = sorted(set(ver.tolist()))
    assert present == [0, 1, 2]
    n = torch.tensor([float((ver == j).sum()) for j in present], dtype=torch.float64)
    mix = torch.stack([torch.where(ver == j, behav, under[j]) for j in present])
    expected = under[2] - torch.logsumexp(torch.log(n / n.sum())[:, None] + mix, dim=0)
    got = torch.cat(terms.per_token["log_is_weight"])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert terms.normalizer is None  # pooled token mean
    stats = trainer.train_step([[t for t in fresh]])
    assert stats["replay_replayed"] == len(batch.replayed)


# ------------------------------------------------------------------ config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["replay.enable=true", "algo.loss=ppo"], "needs algo.loss='decoupled'"),
        (["replay.threshold=0.1"], "not both"),
        (["replay.pmis=false", "replay.weighting=balance"], "needs replay.pmis=true"),
        (["replay.quantile=null"], "needs replay.quantile or replay.threshold"),
        (
            ["replay.enable=true", "algo.aggregation=seq_sum"],
            "needs algo.aggregation='token_mean'",
        ),
        (["replay.k=0"], "replay.k"),
    ],
)
def test_replay_config_errors(overrides, message):
    with pytest.raises(RelayError, match=message):
        load_config(None, overrides)
    load_config(None, ["replay.quantile=null", "replay.threshold=0.1"])
    load_config(None, ["replay.select=none", "replay.quantile=null"])
