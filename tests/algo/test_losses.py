"""Policy losses against hand-computed values on 2–4 token examples, and the micro-batch
invariance of the gradient."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algo.losses import (
    LossConfig,
    entropy_from_logits,
    kl_estimate,
    loss_normalizer,
    policy_loss,
)
from relayrl.algo.microbatch import pack_micro_batches

torch.set_num_threads(1)
F64 = torch.float64


def lp(*probs: float) -> torch.Tensor:
    return torch.tensor(probs, dtype=F64).log()


def ones(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.bool)


# --------------------------------------------------------------------------------- PPO

# μ = 0.5 everywhere; π_θ = [0.7, 0.3, 0.5] -> r = [1.4, 0.6, 1.0]; A = [1, -1, 2]
PPO_BEHAV = lp(0.5, 0.5, 0.5)
PPO_THETA = (0.7, 0.3, 0.5)
PPO_ADV = torch.tensor([1.0, -1.0, 2.0], dtype=F64)


def test_ppo_value_gradient_and_clip_fraction() -> None:
    logp = lp(*PPO_THETA).requires_grad_()
    out = policy_loss(logp, PPO_BEHAV, PPO_ADV, ones(3), LossConfig(eps_high=0.2, loss="ppo"), 3.0)
    # t1: -min(1.4, 1.2) = -1.2 (clipped); t2: -min(-0.6, -0.8) = 0.8 (clipped); t3: -2
    assert out.loss_sum.item() == pytest.approx(-2.4)
    assert out.loss.item() == pytest.approx(-0.8)
    out.loss.backward()
    # only t3 is unclipped: d/dlogp (-r·A)/3 = -1·2/3
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, -2 / 3])
    assert out.stats["clip_frac"] == pytest.approx(2 / 3)
    assert out.stats["ratio_mean"] == pytest.approx((1.4 + 0.6 + 1.0) / 3)
    assert out.num_tokens == 3


def test_ppo_clip_higher() -> None:
    cfg = LossConfig(loss="ppo", eps_low=0.2, eps_high=0.5)
    out = policy_loss(lp(*PPO_THETA), PPO_BEHAV, PPO_ADV, ones(3), cfg, 1.0)
    # t1 now unclipped: -1.4; t2 still 0.8; t3 -2
    assert out.loss.item() == pytest.approx(-2.6)


def test_dual_clip_caps_negative_advantage_loss() -> None:
    # r = [4, 4]: A = -1 -> -min(-4, -1.2) = 4, dual cap -c·A = 3; A = +1 -> -1.2 (no dual)
    logp = lp(0.4, 0.4).requires_grad_()
    behav = lp(0.1, 0.1)
    adv = torch.tensor([-1.0, 1.0], dtype=F64)
    out = policy_loss(
        logp, behav, adv, ones(2), LossConfig(eps_high=0.2, loss="ppo", dual_clip=3.0), 1.0
    )
    assert out.loss.item() == pytest.approx(3.0 - 1.2)
    out.loss.backward()
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0])
    assert out.stats["dual_clip_frac"] == pytest.approx(0.5)
    no_dual = policy_loss(logp, behav, adv, ones(2), LossConfig(eps_high=0.2, loss="ppo"), 1.0)
    assert no_dual.loss.item() == pytest.approx(4.0 - 1.2)


def test_dual_clip_inactive_below_cap() -> None:
    # r = 0.5, A = -1: -min(-0.5, -0.8) = 0.8 < 3 -> unchanged
    out = policy_loss(
        lp(0.25),
        lp(0.5),
        torch.tensor([-1.0], dtype=F64),
        ones(1),
        LossConfig(eps_high=0.2, loss="ppo", dual_clip=3.0),
        1.0,
    )
    assert out.loss.item() == pytest.approx(0.8)


# --------------------------------------------------------------------------- decoupled

# 4 tokens, 2 sequences (seq_ids [0, 0, 1, 1]); μ = 0.5 everywhere
# π_prox = [0.6, 0.25, 0.5, 0.8] -> w = [1.2, 0.5, 1.0, 1.6]
# u = π_θ/π_prox = [1.4, 0.6, 1.1, 1.0] -> π_θ = [0.84, 0.15, 0.55, 0.8]
# A = [1, -1, 2, -0.5] -> inner −min(uA, clip(u)A) = [-1.2, 0.8, -2.2, 0.5]
BEHAV = lp(0.5, 0.5, 0.5, 0.5)
PROX = lp(0.6, 0.25, 0.5, 0.8)
THETA = (0.84, 0.15, 0.55, 0.8)
ADV = torch.tensor([1.0, -1.0, 2.0, -0.5], dtype=F64)
SEQ = torch.tensor([0, 0, 1, 1])


def dec(cfg: LossConfig, **kw: object):
    logp = lp(*THETA).requires_grad_()
    out = policy_loss(logp, BEHAV, ADV, ones(4), cfg, 1.0, prox_logprobs=PROX, seq_ids=SEQ, **kw)
    return out, logp


def test_decoupled_value_gradient_and_stats() -> None:
    out, logp = dec(LossConfig(eps_high=0.2, loss="decoupled"))
    # w·inner = [-1.44, 0.4, -2.2, 0.8]
    assert out.loss.item() == pytest.approx(-2.44)
    out.loss.backward()
    # d/dlogp of -w·u·A where unclipped: t3: -1·1.1·2 = -2.2; t4: -1.6·1·(-0.5) = 0.8
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, -2.2, 0.8])
    assert out.stats["is_weight_mean"] == pytest.approx((1.2 + 0.5 + 1.0 + 1.6) / 4)
    assert out.stats["is_weight_max"] == pytest.approx(1.6)
    assert out.stats["ratio_mean"] == pytest.approx((1.4 + 0.6 + 1.1 + 1.0) / 4)
    assert out.stats["clip_frac"] == pytest.approx(0.5)
    # k3 of prox vs behav: Σ (w − 1 − log w) / 4
    k3 = sum(w - 1 - math.log(w) for w in (1.2, 0.5, 1.0, 1.6)) / 4
    assert out.stats["behav_kl_k3"] == pytest.approx(k3)


@pytest.mark.parametrize(
    ("level", "mode", "cap", "floor", "expected", "dropped"),
    [
        # w = [1.2, .5, 1, 1.6] -> [1.2, .5, 1, 1.5]: -1.44 + .4 - 2.2 + .75
        ("token", "truncate", 1.5, None, -2.49, 0.0),
        # keep w in [.6, 1.5]: t1, t3 -> -1.44 - 2.2
        ("token", "mask", 1.5, 0.6, -3.64, 0.5),
        # sequence w = [.6, 1.6] -> [.6, 1.5]: .6·(-.4) + 1.5·(-1.7)
        ("sequence", "truncate", 1.5, None, -2.79, 0.0),
        # keep seq w in [.5, 1.5]: seq0 only -> .6·(-.4)
        ("sequence", "mask", 1.5, 0.5, -0.24, 0.5),
        # geometric w = [sqrt(.6), sqrt(1.6)] = [.7745967, 1.2649111] -> [.7745967, 1.2]
        ("geometric", "truncate", 1.2, None, 0.7745967 * -0.4 + 1.2 * -1.7, 0.0),
        # keep geometric w in [.8, 1.3]: seq1 only -> 1.2649111·(-1.7)
        ("geometric", "mask", 1.3, 0.8, 1.2649111 * -1.7, 0.5),
    ],
)
def test_importance_correction_levels_and_modes(
    level: str, mode: str, cap: float, floor: float | None, expected: float, dropped: float
) -> None:
    cfg = LossConfig(eps_high=0.2, is_level=level, is_mode=mode, is_cap=cap, is_floor=floor)  # type: ignore[arg-type]
    out, _ = dec(cfg)
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    if mode == "mask":
        assert out.stats["is_masked_frac"] == pytest.approx(dropped)
    else:
        assert out.stats["is_truncated_frac"] == pytest.approx({"token": 0.25}.get(level, 0.5))


def _padded(t: torch.Tensor) -> torch.Tensor:
    """[4] -> [2, 3]: sequences (t0, t1) and (t2, t3), each padded with a garbage value."""
    junk = t.new_full((1,), 7.0)
    return torch.stack([torch.cat([t[:2], junk]), torch.cat([t[2:], -junk])])


def test_sequence_level_on_padded_rows_matches_flat() -> None:
    cfg = LossConfig(eps_high=0.2, is_level="sequence", is_mode="truncate", is_cap=1.5)
    flat, _ = dec(cfg)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    args = (_padded(lp(*THETA)), _padded(BEHAV), _padded(ADV), mask, cfg, 1.0)
    out = policy_loss(*args, prox_logprobs=_padded(PROX))
    assert out.loss.item() == pytest.approx(flat.loss.item())
    assert out.loss.item() == pytest.approx(-2.79)


def test_mask_floor_defaults_to_inverse_cap() -> None:
    # cap 2 -> floor .5: w = [1.2, .5, 1, 1.6] all kept -> same as no correction
    out, _ = dec(LossConfig(eps_high=0.2, is_level="token", is_mode="mask", is_cap=2.0))
    assert out.loss.item() == pytest.approx(-2.44)
    assert out.stats["is_masked_frac"] == 0.0


def test_log_is_weight_overrides_prox_over_behav() -> None:
    log_w = torch.tensor([0.0, 0.0, math.log(2.0), 0.0], dtype=F64)
    out, _ = dec(LossConfig(eps_high=0.2), log_is_weight=log_w)
    # w = [1, 1, 2, 1]: -1.2 + .8 - 4.4 + .5
    assert out.loss.item() == pytest.approx(-4.3)


def test_decoupled_equals_ppo_when_behaviour_is_proximal() -> None:
    g = torch.Generator().manual_seed(0)
    behav = -torch.rand(3, 5, generator=g, dtype=F64) * 3
    theta = behav + 0.3 * torch.randn(3, 5, generator=g, dtype=F64)
    adv = torch.randn(3, 5, generator=g, dtype=F64)
    mask = torch.rand(3, 5, generator=g) > 0.2
    for dual in (None, 2.5):
        grads, values = [], []
        for cfg, prox in (
            (LossConfig(eps_high=0.2, loss="ppo", dual_clip=dual), None),
            (LossConfig(eps_high=0.2, loss="decoupled", dual_clip=dual), behav.clone()),
        ):
            logp = theta.clone().requires_grad_()
            out = policy_loss(logp, behav, adv, mask, cfg, 7.0, prox_logprobs=prox)
            out.loss.backward()
            values.append(out.loss.item())
            grads.append(logp.grad)
        assert values[0] == values[1]
        assert torch.equal(grads[0], grads[1])


def test_recompute_is_decoupled_without_the_behaviour_weight() -> None:
    """AReaL's recompute baseline: the clip around π_prox of decoupled PPO, w ≡ 1."""
    g = torch.Generator().manual_seed(1)
    behav = -torch.rand(3, 5, generator=g, dtype=F64) * 3
    prox = behav + 0.5 * torch.randn(3, 5, generator=g, dtype=F64)  # a stale μ
    theta = prox + 0.3 * torch.randn(3, 5, generator=g, dtype=F64)
    adv = torch.randn(3, 5, generator=g, dtype=F64)
    mask = torch.rand(3, 5, generator=g) > 0.2
    outs = {}
    for loss, log_w in (("recompute", None), ("decoupled", torch.zeros(3, 5, dtype=F64))):
        logp = theta.clone().requires_grad_()
        out = policy_loss(
            logp,
            behav,
            adv,
            mask,
            LossConfig(eps_high=0.2, loss=loss),
            7.0,
            prox_logprobs=prox,
            log_is_weight=log_w,
        )
        out.loss.backward()
        outs[loss] = (out.loss.item(), logp.grad)
    assert outs["recompute"][0] == outs["decoupled"][0]
    assert torch.equal(outs["recompute"][1], outs["decoupled"][1])
    # and by hand on one token: u = e^{0.1}, A = 1 → ℓ = −min(u, 1.28)·1 = −e^{0.1}
    one = torch.ones(1, 1, dtype=torch.bool)
    out = policy_loss(
        torch.tensor([[-1.0]], dtype=F64),
        torch.tensor([[-3.0]], dtype=F64),  # μ far away: ignored
        torch.tensor([[1.0]], dtype=F64),
        one,
        LossConfig(eps_high=0.2, loss="recompute"),
        1.0,
        prox_logprobs=torch.tensor([[-1.1]], dtype=F64),
    )
    assert out.loss.item() == pytest.approx(-math.exp(0.1))


# --------------------------------------------------------------------------------- KL


@pytest.mark.parametrize(
    ("estimator", "kl_sum", "grad"),
    [
        # ρ = log π_ref − log π_θ = [−log 2, log 2]
        ("k1", 0.0, [1.0, 1.0]),  # k1 = −ρ; d/dlogp = 1
        ("k2", math.log(2) ** 2, [math.log(2), -math.log(2)]),  # k2 = ρ²/2; d = −ρ
        ("k3", 0.5, [0.5, -1.0]),  # k3 = e^ρ − 1 − ρ = [.1931472, .3068528]; d = 1 − e^ρ
    ],
)
def test_kl_estimators(estimator: str, kl_sum: float, grad: list[float]) -> None:
    logp = lp(0.5, 0.25).requires_grad_()
    ref = lp(0.25, 0.5)
    cfg = LossConfig(eps_high=0.2, loss="ppo", kl_coef=0.1, kl_estimator=estimator)  # type: ignore[arg-type]
    zero_adv = torch.zeros(2, dtype=F64)
    out = policy_loss(logp, logp.detach(), zero_adv, ones(2), cfg, 2.0, ref_logprobs=ref)
    assert out.loss.item() == pytest.approx(0.1 * kl_sum / 2)
    assert out.stats["kl_ref"] == pytest.approx(kl_sum / 2)
    out.loss.backward()
    assert logp.grad.tolist() == pytest.approx([0.1 * g / 2 for g in grad])
    values = kl_estimate(logp.detach(), ref, estimator)  # type: ignore[arg-type]
    assert values.sum().item() == pytest.approx(kl_sum, abs=1e-12)


def test_kl_off_by_default_and_needs_reference() -> None:
    assert LossConfig(eps_high=0.2).kl_coef == 0.0
    with pytest.raises(ValueError):
        policy_loss(
            lp(0.5),
            lp(0.5),
            torch.zeros(1, dtype=F64),
            ones(1),
            LossConfig(eps_high=0.2, loss="ppo", kl_coef=0.1),
            1.0,
        )


# ------------------------------------------------------------------ config and helpers


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        LossConfig(eps_high=0.2, loss="grpo")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        LossConfig(eps_high=0.2, loss="ppo", is_level="token")
    with pytest.raises(ValueError):
        LossConfig(eps_high=0.2, dual_clip=1.0)
    with pytest.raises(ValueError):
        LossConfig(eps_high=0.2, is_mode="clip")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        policy_loss(
            lp(0.5), lp(0.5), torch.zeros(1, dtype=F64), ones(1), LossConfig(eps_high=0.2), 1.0
        )


def test_loss_normalizer() -> None:
    assert loss_normalizer("token_mean", 37, 4) == 37.0
    assert loss_normalizer("seq_sum", 37, 4, max_len=16) == 64.0
    with pytest.raises(ValueError):
        loss_normalizer("seq_sum", 37, 4)


def test_padding_garbage_never_leaks() -> None:
    logp = torch.tensor([[math.log(0.5), 80.0]], dtype=F64, requires_grad=True)
    behav = torch.tensor([[math.log(0.5), -80.0]], dtype=F64)
    prox = torch.tensor([[math.log(0.5), float("nan")]], dtype=F64)
    adv = torch.tensor([[1.0, float("inf")]], dtype=F64)
    mask = torch.tensor([[True, False]])
    cfg = LossConfig(eps_high=0.2, is_level="sequence", is_mode="mask", is_cap=2.0)
    out = policy_loss(logp, behav, adv, mask, cfg, 1.0, prox_logprobs=prox)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-1.0)
    assert logp.grad.tolist() == [[-1.0, 0.0]]


def test_entropy_stat_from_logits_or_values() -> None:
    logits = torch.zeros(2, 4, dtype=F64)  # uniform over 4 -> entropy log 4
    assert entropy_from_logits(logits).tolist() == pytest.approx([math.log(4)] * 2)
    cfg = LossConfig(eps_high=0.2, loss="ppo")
    a = policy_loss(
        lp(0.5, 0.5), lp(0.5, 0.5), torch.ones(2, dtype=F64), ones(2), cfg, 1.0, entropy=logits
    )
    b = policy_loss(
        lp(0.5, 0.5),
        lp(0.5, 0.5),
        torch.ones(2, dtype=F64),
        ones(2),
        cfg,
        1.0,
        entropy=torch.tensor([1.0, 2.0]),
    )
    assert a.stats["entropy"] == pytest.approx(math.log(4))
    assert b.stats["entropy"] == pytest.approx(1.5)


# ------------------------------------------------- micro-batch invariance of the gradient


def _toy_batch(seed: int):
    """A linear softmax 'policy' over V tokens: logits = x·W. Sequences of varied length,
    behaviour and proximal logprobs from perturbed weights."""
    g = torch.Generator().manual_seed(seed)
    d, vocab = 4, 6
    lengths = [5, 2, 7, 3, 1, 6, 4]
    w = torch.randn(d, vocab, generator=g, dtype=F64)
    feats = [torch.randn(n, d, generator=g, dtype=F64) for n in lengths]
    ids = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]

    def logprobs(weights: torch.Tensor, i: int) -> torch.Tensor:
        return torch.log_softmax(feats[i] @ weights, -1).gather(1, ids[i][:, None])[:, 0]

    behav_w = w + 0.3 * torch.randn(d, vocab, generator=g, dtype=F64)
    prox_w = w + 0.1 * torch.randn(d, vocab, generator=g, dtype=F64)
    ref_w = w + 0.2 * torch.randn(d, vocab, generator=g, dtype=F64)
    seq_adv = torch.randn(len(lengths), generator=g, dtype=F64)
    data = []
    for i, n in enumerate(lengths):
        data.append(
            {
                "behav": logprobs(behav_w, i),
                "prox": logprobs(prox_w, i),
                "ref": logprobs(ref_w, i),
                "adv": seq_adv[i].repeat(n),
                "version": torch.full((n,), i % 3),
            }
        )
    return w, lengths, logprobs, data


def _step_grad(cfg: LossConfig, groups: list[list[int]], seed: int = 0) -> torch.Tensor:
    w0, lengths, logprobs, data = _toy_batch(seed)
    w = w0.clone().requires_grad_()
    norm = loss_normalizer(cfg.aggregation, sum(lengths), len(lengths), max_len=8)
    for group in groups:

        def cat(key: str, group: list[int] = group) -> torch.Tensor:
            return torch.cat([data[i][key] for i in group])

        seq_ids = torch.cat([torch.full((lengths[i],), j) for j, i in enumerate(group)])
        logp = torch.cat([logprobs(w, i) for i in group])
        out = policy_loss(
            logp,
            cat("behav"),
            cat("adv"),
            torch.ones_like(logp, dtype=torch.bool),
            cfg,
            norm,
            prox_logprobs=cat("prox"),
            ref_logprobs=cat("ref"),
            seq_ids=seq_ids,
        )
        out.loss.backward()
    assert w.grad is not None
    return w.grad


@pytest.mark.parametrize(
    "cfg",
    [
        LossConfig(eps_high=0.2, loss="ppo"),
        LossConfig(loss="decoupled", eps_high=0.28, dual_clip=3.0, kl_coef=0.05),
        LossConfig(
            eps_high=0.2,
            is_level="sequence",
            is_mode="truncate",
            is_cap=1.5,
            kl_estimator="k2",
            kl_coef=0.1,
        ),
        LossConfig(
            eps_high=0.2, is_level="geometric", is_mode="mask", is_cap=1.2, aggregation="seq_sum"
        ),
    ],
)
def test_micro_batch_split_does_not_change_gradient(cfg: LossConfig) -> None:
    _, lengths, _, _ = _toy_batch(0)
    full = _step_grad(cfg, [list(range(len(lengths)))])
    groups = pack_micro_batches(lengths, max_tokens=8)
    assert len(groups) > 2
    split = _step_grad(cfg, groups)
    assert full.abs().max() > 1e-3  # a real gradient, not a vacuous zero
    torch.testing.assert_close(split, full, atol=1e-6, rtol=0)
    singles = _step_grad(cfg, [[i] for i in reversed(range(len(lengths)))])
    torch.testing.assert_close(singles, full, atol=1e-6, rtol=0)


def test_engine_trainer_kl_uses_only_tokens_of_the_current_version():
    import math

    from relayrl.algo.losses import engine_trainer_kl

    behav = [[-1.0, -2.0], [-0.5]]
    versions = [[3, 4], [4]]
    prox = [torch.tensor([-1.1, -2.0]), torch.tensor([-0.4])]
    out = engine_trainer_kl(behav, versions, prox, version=4)
    # tokens of version 4: ρ = 0 (k3 = 0) and ρ = 0.1 (k3 = e^0.1 − 1 − 0.1)
    expected = (0.0 + math.expm1(0.1) - 0.1) / 2
    assert out["engine_trainer_kl_tokens"] == 2.0
    assert out["engine_trainer_kl_k3"] == pytest.approx(expected, rel=1e-5)
    assert engine_trainer_kl(behav, versions, prox, version=9) == {}
    assert engine_trainer_kl(behav, versions, None, version=4) == {}


def test_policy_drift_k3_by_hand():
    """Two sequences; the environment token (mask False) is left out of both means."""
    import math

    from relayrl.algo.losses import policy_drift

    behav = [[math.log(0.4), 0.0], [math.log(0.5)]]
    masks = [[True, False], [True]]
    before = [torch.tensor([math.log(0.5), -3.0]), torch.tensor([math.log(0.25)])]
    after = [torch.tensor([math.log(0.4), 7.0]), torch.tensor([math.log(0.5)])]
    out = policy_drift(behav, masks, before, after)
    # drift, KL(π_v ‖ π_v+1): r = π_v+1/π_v = 0.8 and 2.0, k3 = r − 1 − log r
    drift = ((0.8 - 1 - math.log(0.8)) + (2.0 - 1 - math.log(2.0))) / 2
    assert out["drift_kl_k3"] == pytest.approx(drift, rel=1e-6)  # logprobs given in float32
    assert drift == pytest.approx(0.164998, abs=1e-6)
    # behaviour vs proximal, KL(μ ‖ π_v): r = π_v/μ = 1.25 and 0.5
    behav_prox = ((1.25 - 1 - math.log(1.25)) + (0.5 - 1 - math.log(0.5))) / 2
    assert out["behav_prox_kl_k3"] == pytest.approx(behav_prox, rel=1e-6)
    assert set(policy_drift(behav, masks, before)) == {"behav_prox_kl_k3"}
    assert policy_drift([[0.0]], [[False]], [torch.zeros(1)], [torch.zeros(1)]) == {}
