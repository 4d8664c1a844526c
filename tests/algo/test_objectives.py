"""GSPO, CISPO and per-sequence token-mean aggregation against hand-computed values (value
and gradient), and how they compose with the decoupled / behaviour-weight machinery."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algo.losses import LossConfig, loss_normalizer, policy_loss

torch.set_num_threads(1)
F64 = torch.float64


def lp(*rows: tuple[float, ...]) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64).log()


def t64(*rows: tuple[float, ...]) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def assert_close(actual: torch.Tensor | None, expected: list[list[float]]) -> None:
    assert actual is not None
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=F64), rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------- seq_mean_token_mean

# two sequences, padded [2, 3]: lengths 2 and 3; r = 1 everywhere so ℓ_t = −A_t
AGG_MASK = t64((1, 1, 0), (1, 1, 1))
AGG_ADV = t64((1.0, 1.0, 0.0), (-2.0, -2.0, -2.0))
AGG_LOGP = lp((0.5, 0.4, 1.0), (0.3, 0.2, 0.6))


def test_seq_mean_token_mean_value_and_gradient() -> None:
    cfg = LossConfig(eps_high=0.2, loss="ppo", aggregation="seq_mean_token_mean")
    z = loss_normalizer("seq_mean_token_mean", num_tokens=5, num_seqs=2)
    assert z == 2.0
    logp = AGG_LOGP.clone().requires_grad_()
    out = policy_loss(logp, AGG_LOGP, AGG_ADV, AGG_MASK, cfg, z)
    # sequence means: (−1 − 1)/2 = −1 and (2 + 2 + 2)/3 = 2; their mean 0.5
    assert out.loss.item() == pytest.approx(0.5)
    out.loss.backward()
    # dℓ_t/dlogp_t = −A_t·r = −A_t, over |y_i| and the 2 sequences
    assert_close(logp.grad, [[-0.25, -0.25, 0.0], [1 / 3, 1 / 3, 1 / 3]])


def test_seq_mean_token_mean_is_trl_grpo_and_split_invariant() -> None:
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(4, 6, generator=g) < 0.7).to(F64)
    mask[:, 0] = 1
    behav = -torch.rand(4, 6, generator=g, dtype=F64) - 0.5
    theta = behav + 0.3 * torch.randn(4, 6, generator=g, dtype=F64)
    adv = torch.randn(4, 1, generator=g, dtype=F64).expand(4, 6).contiguous()
    cfg = LossConfig(eps_high=0.2, loss="ppo", aggregation="seq_mean_token_mean")
    logp = theta.clone().requires_grad_()
    out = policy_loss(logp, behav, adv, mask, cfg, 4.0)
    # TRL's loss_type="grpo": per-token loss, token mean per sequence, mean over sequences
    ratio = torch.exp(theta - behav)
    per_token = torch.maximum(-ratio * adv, -ratio.clamp(0.8, 1.2) * adv)
    expected = ((per_token * mask).sum(-1) / mask.sum(-1)).mean()
    assert out.loss.item() == pytest.approx(expected.item(), abs=1e-12)
    out.loss.backward()
    # micro-batches of one row each, same normaliser: the same gradient
    grads = []
    for row in range(4):
        part = theta[row : row + 1].clone().requires_grad_()
        policy_loss(
            part, behav[row : row + 1], adv[row : row + 1], mask[row : row + 1], cfg, 4.0
        ).loss.backward()
        grads.append(part.grad)
    assert torch.allclose(torch.cat(grads), logp.grad, atol=1e-12)


# ---------------------------------------------------------------------------- GSPO

# seq 0: π_θ = [0.6, 0.2], π_prox = [0.4, 0.25] -> s_0 = exp(mean(log 1.5, log 0.8)) = √1.2
# seq 1 (one token, then padding): π_θ = 0.6, π_prox = 0.4 -> s_1 = 1.5
G_MASK = t64((1, 1), (1, 0))
G_THETA = lp((0.6, 0.2), (0.6, 1.0))
G_PROX = lp((0.4, 0.25), (0.4, 1.0))
G_ADV = t64((1.0, 2.0), (1.0, 0.0))  # per-token advantages on sequence 0 (GSPO-token)
S0 = math.sqrt(1.2)


def gspo(**kw: object) -> LossConfig:
    return LossConfig(loss="gspo", gspo_eps_low=0.1, gspo_eps_high=0.1, **kw)  # type: ignore[arg-type]


def test_gspo_on_policy_value_and_gradient() -> None:
    logp = G_THETA.clone().requires_grad_()
    out = policy_loss(logp, G_PROX, G_ADV, G_MASK, gspo(), 3.0, prox_logprobs=G_PROX)
    # seq 0: s_0 = 1.0954 ∈ [0.9, 1.1] -> ℓ = −s_0·A_t; seq 1: s_1 = 1.5 clipped to 1.1
    assert out.loss.item() == pytest.approx((-S0 * 1 - S0 * 2 - 1.1) / 3)
    out.loss.backward()
    # GSPO-token: ∂ℓ_t/∂log π_θ(y_t) = −s_i·A_t; the clipped sequence gets no gradient
    assert_close(logp.grad, [[-S0 / 3, -2 * S0 / 3], [0.0, 0.0]])
    assert out.stats["clip_frac"] == pytest.approx(1 / 3)
    assert out.stats["ratio_mean"] == pytest.approx((2 * S0 + 1.5) / 3)


def test_gspo_negative_advantage_keeps_the_pessimistic_term() -> None:
    adv = t64((1.0, 2.0), (-1.0, 0.0))
    logp = G_THETA.clone().requires_grad_()
    out = policy_loss(logp, G_PROX, adv, G_MASK, gspo(), 3.0, prox_logprobs=G_PROX)
    # seq 1: max(−1.5·(−1), −1.1·(−1)) = 1.5, unclipped: gradient −A·s = 1.5
    assert out.loss.item() == pytest.approx((-3 * S0 + 1.5) / 3)
    out.loss.backward()
    assert logp.grad[1, 0].item() == pytest.approx(1.5 / 3)


# μ: seq 0 [0.2, 0.25] -> π_prox/μ = [2, 1]; seq 1 0.4 (fresh)
G_BEHAV = lp((0.2, 0.25), (0.4, 1.0))


@pytest.mark.parametrize(
    ("kw", "w0"),
    [
        ({"is_level": "none"}, [2.0, 1.0]),  # token weights, untruncated (AReaL)
        ({"is_level": "geometric", "is_cap": 10.0}, [math.sqrt(2)] * 2),
        ({"is_level": "geometric", "is_cap": 1.2}, [1.2, 1.2]),  # truncated
        ({"is_level": "sequence", "is_cap": 10.0}, [2.0, 2.0]),
        ({"is_level": "geometric", "is_mode": "mask", "is_cap": 1.2}, [0.0, 0.0]),
    ],
)
def test_gspo_under_staleness_weight_times_prox_ratio(kw: dict, w0: list[float]) -> None:
    """The clip is decided on s_i (to π_prox); μ's staleness enters only as w."""
    logp = G_THETA.clone().requires_grad_()
    out = policy_loss(logp, G_BEHAV, G_ADV, G_MASK, gspo(**kw), 3.0, prox_logprobs=G_PROX)
    expected = -w0[0] * S0 * 1 - w0[1] * S0 * 2 - 1.1
    assert out.loss.item() == pytest.approx(expected / 3)
    out.loss.backward()
    assert_close(logp.grad, [[-w0[0] * S0 / 3, -2 * w0[1] * S0 / 3], [0, 0]])


def test_gspo_geometric_weight_gives_gspo_ratio_to_behaviour() -> None:
    """w_i·s_i = exp(mean log(π_θ/μ)): GSPO's ratio against μ, with the trust region kept
    around π_prox (√2.4 = 1.549 is far outside [0.9, 1.1], s_0 = 1.095 is not)."""
    cfg = gspo(is_level="geometric", is_cap=10.0)
    out = policy_loss(G_THETA, G_BEHAV, G_ADV, G_MASK, cfg, 1.0, prox_logprobs=G_PROX)
    to_mu = math.exp((math.log(0.6 / 0.2) + math.log(0.2 / 0.25)) / 2)
    assert to_mu == pytest.approx(math.sqrt(2.4))
    assert out.loss_sum.item() == pytest.approx(-to_mu * 3 - 1.1)


def test_gspo_with_one_token_sequences_is_decoupled_ppo() -> None:
    g = torch.Generator().manual_seed(1)
    prox = -torch.rand(5, 1, generator=g, dtype=F64) - 0.5
    behav = prox + 0.2 * torch.randn(5, 1, generator=g, dtype=F64)
    theta = prox + 0.3 * torch.randn(5, 1, generator=g, dtype=F64)
    adv = torch.randn(5, 1, generator=g, dtype=F64)
    mask = torch.ones(5, 1, dtype=F64)
    kw = {"is_level": "token", "is_cap": 1.5}
    grads = []
    for cfg in (
        LossConfig(loss="gspo", gspo_eps_low=0.1, gspo_eps_high=0.15, **kw),
        LossConfig(loss="decoupled", eps_low=0.1, eps_high=0.15, **kw),
    ):
        logp = theta.clone().requires_grad_()
        out = policy_loss(logp, behav, adv, mask, cfg, 5.0, prox_logprobs=prox)
        out.loss.backward()
        grads.append((out.loss.item(), logp.grad))
    assert grads[0][0] == pytest.approx(grads[1][0], abs=1e-12)
    assert torch.allclose(grads[0][1], grads[1][1], atol=1e-12)


def test_gspo_needs_prox_and_default_clip_range() -> None:
    cfg = LossConfig(eps_high=0.2, loss="gspo")
    assert (cfg.gspo_eps_low, cfg.gspo_eps_high) == (3e-4, 4e-4)
    with pytest.raises(ValueError, match="prox_logprobs"):
        policy_loss(G_THETA, G_PROX, G_ADV, G_MASK, cfg, 1.0)


# --------------------------------------------------------------------------- CISPO

# π_θ = [0.5, 0.1, 0.9], μ = [0.25, 0.2, 0.1] -> r = [2, 0.5, 9]; cap 5 -> w = [2, 0.5, 5]
C_THETA = lp((0.5, 0.1, 0.9))
C_BEHAV = lp((0.25, 0.2, 0.1))
C_ADV = t64((1.0, -1.0, 2.0))
C_MASK = t64((1, 1, 1))


def test_cispo_value_gradient_and_clip_fraction() -> None:
    logp = C_THETA.clone().requires_grad_()
    out = policy_loss(logp, C_BEHAV, C_ADV, C_MASK, LossConfig(eps_high=0.2, loss="cispo"), 3.0)
    expected = -2 * 1 * math.log(0.5) - 0.5 * (-1) * math.log(0.1) - 5 * 2 * math.log(0.9)
    assert out.loss.item() == pytest.approx(expected / 3)
    out.loss.backward()
    # every token keeps its gradient −sg(min(r, C))·A, the capped one included
    assert_close(logp.grad, [[-2 / 3, 0.5 / 3, -10 / 3]])
    assert out.stats["clip_frac"] == pytest.approx(1 / 3)


def test_cispo_rejects_a_separate_behaviour_weight() -> None:
    with pytest.raises(ValueError, match="is_level"):
        LossConfig(eps_high=0.2, loss="cispo", is_level="token")


def _random_stale_batch(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    prox = -torch.rand(3, 5, generator=g, dtype=F64) - 0.3
    behav = prox + 0.8 * torch.randn(3, 5, generator=g, dtype=F64)
    adv = torch.randn(3, 1, generator=g, dtype=F64).expand(3, 5).contiguous()
    mask = (torch.rand(3, 5, generator=g) < 0.8).to(F64)
    return prox, behav, adv, mask


def _grad(
    cfg: LossConfig,
    theta: torch.Tensor,
    behav: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    prox: torch.Tensor | None = None,
) -> torch.Tensor:
    logp = theta.clone().requires_grad_()
    policy_loss(logp, behav, adv, mask, cfg, 7.0, prox_logprobs=prox).loss.backward()
    assert logp.grad is not None
    return logp.grad


def test_cispo_at_the_step_start_is_decoupled_with_token_tis() -> None:
    """At θ = π_prox (the first AdamW step of a batch) CISPO's gradient −min(π_prox/μ, C)·A
    equals decoupled PPO's with token-level truncation at C (u = 1: the clip never acts)."""
    prox, behav, adv, mask = _random_stale_batch(2)
    cispo = _grad(LossConfig(eps_high=0.2, loss="cispo", cispo_cap=1.5), prox, behav, adv, mask)
    tis = LossConfig(
        eps_high=0.2, loss="decoupled", is_level="token", is_mode="truncate", is_cap=1.5
    )
    decoupled = _grad(tis, prox, behav, adv, mask, prox)
    assert torch.allclose(cispo, decoupled, atol=1e-12)
    # and on-policy (μ = π_θ) it is the plain policy gradient, PPO's at r = 1
    ppo = _grad(LossConfig(eps_high=0.2, loss="ppo"), prox, prox, adv, mask)
    on_policy = _grad(LossConfig(eps_high=0.2, loss="cispo"), prox, prox, adv, mask)
    assert torch.allclose(on_policy, ppo, atol=1e-12)


def test_config_accepts_the_new_objectives() -> None:
    from relayrl.config.schema import AlgoConfig

    algo = AlgoConfig(loss="gspo", aggregation="seq_mean_token_mean", advantage="reinforce_pp")
    assert algo.gspo_eps_low == 3e-4 and algo.gamma == 1.0
    assert AlgoConfig(loss="cispo", cispo_cap=2.0).cispo_cap == 2.0
    with pytest.raises(ValueError, match="cispo_cap"):
        LossConfig(eps_high=0.2, loss="cispo", cispo_cap=0.0)


def test_gspo_token_with_sequence_advantages_is_the_gspo_sequence_objective() -> None:
    """One advantage per sequence, w ≡ 1, per-sequence token means: value and gradient of
    (1/B) Σ_i −min(s_i·A_i, clip(s_i)·A_i) with s_i differentiated through its mean."""
    g = torch.Generator().manual_seed(3)
    prox = -torch.rand(4, 5, generator=g, dtype=F64) - 0.3
    theta = prox + 0.3 * torch.randn(4, 5, generator=g, dtype=F64)
    adv = torch.randn(4, 1, generator=g, dtype=F64).expand(4, 5).contiguous()
    mask = (torch.rand(4, 5, generator=g) < 0.8).to(F64)
    mask[:, 0] = 1
    cfg = LossConfig(
        loss="gspo", gspo_eps_low=0.05, gspo_eps_high=0.05, aggregation="seq_mean_token_mean"
    )
    logp = theta.clone().requires_grad_()
    out = policy_loss(logp, prox, adv, mask, cfg, 4.0, prox_logprobs=prox)
    out.loss.backward()
    ref = theta.clone().requires_grad_()
    s = torch.exp(((ref - prox) * mask).sum(-1) / mask.sum(-1))
    a = adv[:, 0]
    expected = torch.maximum(-s * a, -s.clamp(0.95, 1.05) * a).mean()
    expected.backward()
    assert 0 < out.stats["clip_frac"] < 1  # both branches are exercised
    assert out.loss.item() == pytest.approx(expected.item(), abs=1e-12)
    assert ref.grad is not None
    torch.testing.assert_close(logp.grad, ref.grad * mask, rtol=1e-9, atol=1e-12)
