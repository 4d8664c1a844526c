"""D-ARL maths against hand-computed and closed-form values. The loss is composed as the
trainer composes it (:func:`darl_loss`: ``behaviour_plan`` over the step, its per-token
coefficients as ``policy_loss``'s ``token_coef`` with normaliser 1); the selection the
trainer applies is tested in tests/buffer/test_replay_training.py."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algo.darl import (
    balance_heuristic_logweights,
    behaviour_plan,
    effective_sample_size,
    effective_sample_size_from_log,
    policy_weights,
    selection_cutoff,
    variance_scores,
)
from relayrl.algo.losses import LossConfig, loss_normalizer, policy_loss
from relayrl.algo.microbatch import pack_micro_batches

torch.set_num_threads(1)
F64 = torch.float64


def lp(*probs: float) -> torch.Tensor:
    return torch.tensor(probs, dtype=F64).log()


def darl_loss(logp, prox, behav, adv, mask, versions, cfg, *, weighting="ess", plan=None, **kw):
    """``L = Σ_k α_k L_k`` as the trainer computes it (train/replay_step.py ``loss_terms``,
    then ``policy_loss`` per micro-batch): the plan over the step unless given, ``c_t`` as
    ``token_coef``, normaliser 1. Returns the loss output and the plan."""
    if plan is None:
        plan = behaviour_plan(prox, behav, mask, versions, weighting)
    coef = plan.token_coef(versions, mask)
    out = policy_loss(logp, behav, adv, mask, cfg, 1.0, prox_logprobs=prox, token_coef=coef, **kw)
    return out, plan


# ------------------------------------------------------------------------- scores


def test_variance_score_padded_rows() -> None:
    # row 0: w = [1.2, 0.5] -> ((0.2)² + (0.5)²)/2 = 0.145 = Var (0.1225) + (0.85 − 1)²
    # row 1: w = [1, 1] (third position is padding) -> 0
    prox = torch.stack([lp(0.6, 0.25, 0.9), lp(0.3, 0.3, 0.9)])
    behav = torch.stack([lp(0.5, 0.5, 0.1), lp(0.3, 0.3, 0.2)])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    assert variance_scores(prox, behav, mask).tolist() == pytest.approx([0.145, 0.0])


def test_variance_score_flat_with_seq_ids() -> None:
    prox = lp(0.6, 0.25, 0.8)
    behav = lp(0.5, 0.5, 0.5)  # w = [1.2, 0.5, 1.6]
    seq = torch.tensor([0, 0, 1])
    mask = torch.ones(3, dtype=torch.bool)
    assert variance_scores(prox, behav, mask, seq).tolist() == pytest.approx([0.145, 0.36])


# ---------------------------------------------------------------------- selection


def test_selection_cutoff() -> None:
    ref = [0.3, 0.0, 0.1, 0.2]
    assert selection_cutoff(ref, 0.5, None) == pytest.approx(0.15)
    assert selection_cutoff(ref, 0.9, None) == pytest.approx(0.27)  # 0.2 + 0.7·0.1
    assert selection_cutoff(ref, None, 0.05) == 0.05
    assert selection_cutoff(ref, None, None) == math.inf
    assert selection_cutoff([], 0.5, None) == -math.inf  # no reference: keep nothing stale
    for bad in ((0.5, 0.1), (1.5, None)):
        with pytest.raises(ValueError):
            selection_cutoff(ref, *bad)


def test_effective_sample_size() -> None:
    w = torch.tensor([1.0, 1.0, 2.0])
    assert effective_sample_size(w) == pytest.approx(16 / 6)  # (1+1+2)² / (1+1+4)
    assert effective_sample_size(torch.ones(5)) == pytest.approx(5.0)
    assert effective_sample_size(torch.tensor([3.0, 0.0, 0.0])) == pytest.approx(1.0)
    assert effective_sample_size(w, mask=torch.tensor([1, 0, 1])) == pytest.approx(9 / 5)
    assert effective_sample_size(torch.zeros(0)) == 0.0
    # log form is exact and does not overflow
    assert effective_sample_size_from_log(w.log()) == pytest.approx(16 / 6)
    big = torch.tensor([1000.0, 1000.0, 1000.0 + math.log(2.0)], dtype=F64)
    assert effective_sample_size_from_log(big) == pytest.approx(16 / 6)


def test_policy_weights() -> None:
    assert policy_weights({0: 2.0, 1: 6.0}) == pytest.approx({0: 0.25, 1: 0.75})
    assert policy_weights({4: 1.8, 7: 1.0}) == pytest.approx({4: 1.8 / 2.8, 7: 1 / 2.8})
    assert policy_weights({0: 0.0, 1: 0.0}) == {0: 0.5, 1: 0.5}
    assert policy_weights({}) == {}


# ------------------------------------------------------------ multi-behaviour loss

# Three tokens: a, b from version 0 with w = [1, 2]; c from version 1 with w = 0.5.
# ESS_0 = 9/5 = 1.8, ESS_1 = 1 -> α_0 = 1.8/2.8, α_1 = 1/2.8.
# u = π_θ/π_prox = [1.3, 1.3, 0.9], A = [1, -1, 2], ε = 0.2:
#   a: −w·min(1.3, 1.2) = −1.2 (clipped, zero gradient)
#   b: −w·min(−1.3, −1.2) = 2·1.3 = 2.6, d/dlogp = −w·u·A = 2.6
#   c: −w·min(1.8, 1.8) = −0.9,             d/dlogp = −0.5·0.9·2 = −0.9
# L = α_0/2·(ℓ_a + ℓ_b) + α_1·ℓ_c
BEHAV = lp(0.4, 0.2, 0.6)
PROX = lp(0.4, 0.4, 0.3)
THETA = (0.52, 0.52, 0.27)
ADV = torch.tensor([1.0, -1.0, 2.0], dtype=F64)
VERS = torch.tensor([0, 0, 1])
MASK = torch.ones(3, dtype=torch.bool)
A0, A1 = 1.8 / 2.8, 1.0 / 2.8


def test_multi_behaviour_value_and_hand_derived_gradient() -> None:
    logp = lp(*THETA).requires_grad_()
    out, plan = darl_loss(logp, PROX, BEHAV, ADV, MASK, VERS, LossConfig(eps_high=0.2))
    assert plan.ess == pytest.approx({0: 1.8, 1: 1.0})
    assert plan.alphas == pytest.approx({0: A0, 1: A1})
    assert plan.token_counts == {0: 2, 1: 1}
    assert plan.coef_by_version == pytest.approx({0: A0 / 2, 1: A1})
    assert out.loss.item() == pytest.approx(A0 / 2 * (-1.2 + 2.6) + A1 * -0.9)
    assert out.loss.item() == pytest.approx(0.1285714, abs=1e-7)
    out.loss.backward()
    assert logp.grad.tolist() == pytest.approx([0.0, A0 / 2 * 2.6, A1 * -0.9])
    assert logp.grad.tolist() == pytest.approx([0.0, 0.8357143, -0.3214286], abs=1e-7)


def test_uniform_and_balance_weighting_pool_every_token() -> None:
    # uniform: α_k = N_k/N (every token 1/N, no policy-level reweighting); balance the same
    for weighting in ("uniform", "balance"):
        plan = behaviour_plan(PROX, BEHAV, MASK, VERS, weighting)
        assert plan.alphas == pytest.approx({0: 2 / 3, 1: 1 / 3})
        assert plan.coef_by_version == pytest.approx({0: 1 / 3, 1: 1 / 3})
    coef = plan.token_coef(VERS, torch.tensor([True, False, True]))
    assert coef.tolist() == pytest.approx([1 / 3, 0.0, 1 / 3])
    with pytest.raises(ValueError):
        behaviour_plan(PROX, BEHAV, MASK, VERS, "equal")  # type: ignore[arg-type]


def two_token_loss(versions: list[int], weighting: str):
    logp = lp(0.44, 0.21).requires_grad_()
    out, plan = darl_loss(
        logp,
        lp(0.4, 0.3),
        lp(0.5, 0.2),
        torch.tensor([2.0, -1.0], dtype=F64),
        torch.ones(2, dtype=torch.bool),
        torch.tensor(versions),
        LossConfig(eps_high=0.2),
        weighting=weighting,  # type: ignore[arg-type]
    )
    out.loss.backward()
    return out.loss.item(), logp.grad.tolist(), plan


def test_two_token_gradient_by_hand() -> None:
    """Token a (version 0): μ = .5, π_prox = .4, π_θ = .44, A = 2 → w = .8, u = 1.1 (inside
    the clip range): ℓ_a = −.8·1.1·2 = −1.76, ∂ℓ_a/∂log π_θ = −w·u·A = −1.76.
    Token b (version 1): μ = .2, π_prox = .3, π_θ = .21, A = −1 → w = 1.5, u = .7 < .8:
    −min(−.7, −.8) = .8 is the clipped branch, ℓ_b = 1.2, zero gradient.
    One token per version → ESS_k = 1, α = (½, ½), N_k = 1:
    L = ½ℓ_a + ½ℓ_b = −0.28, ∂L/∂log π_θ = (−0.88, 0)."""
    loss, grad, plan = two_token_loss([0, 1], "ess")
    assert plan.alphas == pytest.approx({0: 0.5, 1: 0.5})
    assert loss == pytest.approx(-0.28)
    assert grad == pytest.approx([-0.88, 0.0])
    # one version, uniform pool: L = (ℓ_a + ℓ_b)/2, the same numbers
    loss, grad, _ = two_token_loss([0, 0], "uniform")
    assert (loss, grad) == (pytest.approx(-0.28), pytest.approx([-0.88, 0.0]))


def test_k1_no_selection_uniform_reduces_to_decoupled_ppo() -> None:
    g = torch.Generator().manual_seed(3)
    shape = (4, 6)
    behav = -torch.rand(shape, generator=g, dtype=F64) * 2
    prox = behav + 0.2 * torch.randn(shape, generator=g, dtype=F64)
    theta = prox + 0.2 * torch.randn(shape, generator=g, dtype=F64)
    adv = torch.randn(shape, generator=g, dtype=F64)
    mask = torch.rand(shape, generator=g) > 0.25
    versions = torch.full(shape, 7)
    scores = variance_scores(prox, behav, mask)
    assert selection_cutoff(scores.tolist(), None, None) == math.inf  # select=none keeps all
    cfg = LossConfig(eps_high=0.28, dual_clip=3.0)
    n = int(mask.sum())
    for weighting in ("uniform", "ess"):
        a = theta.clone().requires_grad_()
        b = theta.clone().requires_grad_()
        darl, _ = darl_loss(a, prox, behav, adv, mask, versions, cfg, weighting=weighting)
        ref = policy_loss(
            b, behav, adv, mask, cfg, loss_normalizer("token_mean", n, 4), prox_logprobs=prox
        )
        darl.loss.backward()
        ref.loss.backward()
        torch.testing.assert_close(darl.loss, ref.loss, atol=1e-12, rtol=0)
        torch.testing.assert_close(a.grad, b.grad, atol=1e-12, rtol=0)


def test_multi_behaviour_loss_over_micro_batches_sums_to_full_loss() -> None:
    g = torch.Generator().manual_seed(5)
    lengths = [4, 1, 6, 3, 5, 2]
    seqs = []
    for i, n in enumerate(lengths):
        behav = -torch.rand(n, generator=g, dtype=F64) * 2
        prox = behav + 0.3 * torch.randn(n, generator=g, dtype=F64)
        seqs.append(
            {
                "behav": behav,
                "prox": prox,
                "theta": prox + 0.2 * torch.randn(n, generator=g, dtype=F64),
                "adv": torch.randn(1, generator=g, dtype=F64).repeat(n),
                "ver": torch.full((n,), i % 3),
            }
        )
    cat = lambda idx, k: torch.cat([seqs[i][k] for i in idx])  # noqa: E731
    everything = list(range(len(lengths)))
    cfg = LossConfig(eps_high=0.2, is_level="token", is_cap=1.5)
    theta_full = cat(everything, "theta").requires_grad_()
    mask_full = torch.ones_like(theta_full, dtype=torch.bool)
    full, plan = darl_loss(
        theta_full,
        cat(everything, "prox"),
        cat(everything, "behav"),
        cat(everything, "adv"),
        mask_full,
        cat(everything, "ver"),
        cfg,
    )
    full.loss.backward()
    assert len(plan.alphas) == 3

    thetas = [s["theta"].clone().requires_grad_() for s in seqs]
    total = torch.zeros((), dtype=F64)
    for group in pack_micro_batches(lengths, 7):
        logp = torch.cat([thetas[i] for i in group])
        out, _ = darl_loss(
            logp,
            cat(group, "prox"),
            cat(group, "behav"),
            cat(group, "adv"),
            torch.ones_like(logp, dtype=torch.bool),
            cat(group, "ver"),
            cfg,
            plan=plan,
        )
        out.loss.backward()
        total = total + out.loss.detach()
    torch.testing.assert_close(total, full.loss.detach(), atol=1e-12, rtol=0)
    torch.testing.assert_close(
        torch.cat([t.grad for t in thetas]), theta_full.grad, atol=1e-12, rtol=0
    )


# ------------------------------------------------------------- balance heuristic


def test_balance_heuristic_bernoulli_closed_form() -> None:
    # one-token Bernoulli policies: π_prox(1) = .5, μ_0(1) = .2, μ_1(1) = .8, n = [1, 3]
    # mixture q(1) = .25·.2 + .75·.8 = .65, q(0) = .25·.8 + .75·.2 = .35
    y = torch.tensor([1, 0, 1, 1])
    bern = lambda p: torch.where(y == 1, torch.tensor(p), torch.tensor(1 - p)).double().log()  # noqa: E731
    log_w = balance_heuristic_logweights(bern(0.5), torch.stack([bern(0.2), bern(0.8)]), [1, 3])
    expected = [0.5 / 0.65, 0.5 / 0.35, 0.5 / 0.65, 0.5 / 0.65]
    assert log_w.exp().tolist() == pytest.approx(expected)
    # unbiased for any f under the mixture: Σ_y q(y) w(y) f(y) = Σ_y π(y) f(y)
    q = {1: 0.65, 0: 0.35}
    w = {1: 0.5 / 0.65, 0: 0.5 / 0.35}
    assert sum(q[v] * w[v] * (3.0 if v else -1.0) for v in (0, 1)) == pytest.approx(0.5 * 3 - 0.5)


def test_balance_heuristic_categorical_log_space_and_zero_count() -> None:
    # 3 outcomes; π_prox = [.2, .3, .5]; μ_0 = [.6, .2, .2], μ_1 = [.1, .1, .8], μ_2 unused
    pi = torch.tensor([0.2, 0.3, 0.5], dtype=F64)
    mus = torch.tensor([[0.6, 0.2, 0.2], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]], dtype=F64)
    y = torch.tensor([0, 1, 2])
    counts = [2, 2, 0]
    log_w = balance_heuristic_logweights(pi[y].log(), mus[:, y].log(), counts)
    mix = 0.5 * mus[0] + 0.5 * mus[1]  # [.35, .15, .5]
    assert log_w.exp().tolist() == pytest.approx((pi / mix).tolist())
    assert log_w.exp().tolist() == pytest.approx([0.2 / 0.35, 2.0, 1.0])
    # very long sequences: log-probabilities of −2000 must not underflow to 0/0
    shifted = balance_heuristic_logweights(pi[y].log() - 2000, mus[:, y].log() - 2000, counts)
    torch.testing.assert_close(shifted, log_w)
    assert not shifted.requires_grad


def test_balance_weights_plug_into_the_loss() -> None:
    # per-token override: every token carries its sequence's balance weight
    log_w = torch.tensor([0.0, 0.0, math.log(0.5)], dtype=F64)
    out, _ = darl_loss(
        lp(*THETA),
        PROX,
        BEHAV,
        ADV,
        MASK,
        VERS,
        LossConfig(eps_high=0.2),
        weighting="balance",
        log_is_weight=log_w,
    )
    # pooled 1/3 per token; w = [1, 1, .5]; inner = [-1.2, 1.3, -1.8]
    assert out.loss.item() == pytest.approx((-1.2 + 1.3 + 0.5 * -1.8) / 3)
