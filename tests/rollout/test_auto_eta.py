"""``rollout.eta=auto``: the rule's η sequence on hand-computed measurements, the per-version
drift it reads, and the config key."""

from __future__ import annotations

import asyncio
import math
import random

import pytest
import torch

from relayrl.algo.losses import stale_kl_per_version
from relayrl.config.loader import load_config
from relayrl.errors import RelayError
from relayrl.rollout.controller import ControllerOptions
from relayrl.rollout.eta import DEFAULT_ETA_BUDGET, AutoEta, StalenessBound


def test_drift_rule_grows_by_one_and_shrinks_at_once():
    rule = AutoEta(eta_max=8, budget=1e-3)
    assert rule.eta == 1  # before any measurement: the safe end
    got = []
    # k̂ (EMA, weight 1/2): -, 1e-4, 1e-4, 2.25e-4, 5.625e-4, 5.625e-4, 2.8625e-4
    # ⌊1e-3 / k̂⌋:         -, 10,   10,   4,       1,        1,        3
    for drift in (None, 1e-4, 1e-4, 3.5e-4, 9e-4, None, 1e-5):
        got.append(rule.update(drift))
    assert got == [1, 2, 3, 4, 1, 1, 2]
    assert rule.drift == pytest.approx(2.8625e-4)
    assert rule.drift_target() == 3


def test_low_drift_reaches_eta_max_and_stays():
    rule = AutoEta(eta_max=8, budget=DEFAULT_ETA_BUDGET)
    # the lag study's low drift: k ≈ 3.8e-5 per version → ⌊2e-3 / 3.8e-5⌋ = 52 → η_max
    assert [rule.update(3.8e-5) for _ in range(10)] == [2, 3, 4, 5, 6, 7, 8, 8, 8, 8]
    # the high drift: k ≈ 2e-2 → ⌊0.1⌋ = 0 → clamped to 1, at once
    assert AutoEta(8).update(2e-2) == 1
    rule.update(2e-2)  # k̂ = (3.8e-5 + 2e-2) / 2 ≈ 1.0e-2
    assert rule.eta == 1


def test_busy_target_from_latency_over_train_time():
    rule = AutoEta(eta_max=8, budget=1.0)  # the drift never binds: ⌊1 / 1e-6⌋ ≫ 8
    got = []
    # r̂ = latency / train time (EMA): 3, 3, 3, 1.75, 1.75, 10.875; ⌈r̂⌉: 3, 3, 3, 2, 2, 11 → 8
    for latency, train in (
        (3.0, 1.0),
        (3.0, 1.0),
        (3.0, 1.0),
        (1.0, 2.0),
        (None, None),
        (20.0, 1.0),
    ):
        got.append(rule.update(1e-6, latency, train))
    assert got == [2, 3, 3, 2, 2, 3]
    assert rule.busy_ratio == pytest.approx(10.875)
    assert rule.busy_target() == 8


def test_state_round_trip_and_bad_settings():
    rule = AutoEta(eta_max=4, budget=1e-3)
    for drift in (1e-4, 1e-4, 2e-4):
        rule.update(drift, 2.0, 1.0)
    other = AutoEta(eta_max=4, budget=1e-3)
    other.load_state_dict(rule.state_dict())
    assert (other.eta, other.drift, other.busy_ratio) == (rule.eta, rule.drift, rule.busy_ratio)
    assert other.update(5e-4, 2.0, 1.0) == rule.update(5e-4, 2.0, 1.0)
    with pytest.raises(ValueError, match="eta_max"):
        AutoEta(eta_max=0)
    with pytest.raises(ValueError, match="eta_budget"):
        AutoEta(eta_max=4, budget=0.0)


def _k3(rho: float) -> float:
    return math.exp(rho) - 1 - rho


def test_stale_kl_per_version_hand_computed():
    """Σ k3 over stale tokens, less the fresh tokens' mean k3 per stale token, / Σ staleness;
    environment tokens (mask false) are not counted."""
    behav = [[-1.0, -2.0], [-0.5, -0.5, -0.5, -3.0]]
    versions = [[5, 5], [3, 4, 4, 2]]
    masks = [[True, True], [True, True, True, False]]
    before = [
        torch.tensor(x, dtype=torch.float64) for x in ([-1.1, -2.0], [-0.7, -0.3, -0.5, -0.1])
    ]
    mismatch = (_k3(-0.1) + _k3(0.0)) / 2
    expected = (_k3(-0.2) + _k3(0.2) + _k3(0.0) - 3 * mismatch) / (2 + 1 + 1)
    got = stale_kl_per_version(behav, versions, masks, before, 5)
    assert got == pytest.approx(expected, rel=1e-12)
    assert stale_kl_per_version(behav[:1], versions[:1], masks[:1], before[:1], 5) is None


def test_config_eta_int_or_auto():
    config = load_config(None, ["rollout.eta=auto", "rollout.eta_max=6"])
    assert (config.rollout.eta, config.rollout.staleness.hard) == ("auto", 6)
    assert config.rollout.eta_budget == DEFAULT_ETA_BUDGET
    assert load_config(None, ["rollout.eta=3"]).rollout.staleness.hard == 3
    for bad in ("fast", "-1", "2.5"):
        with pytest.raises(RelayError, match=r"rollout\.eta.*non-negative integer or 'auto'"):
            load_config(None, [f"rollout.eta={bad}"])


async def _drive_moving_bound(ctrl, servers, rng, steps: int) -> tuple[list[int], int]:
    """Train ``steps`` batches while the bound jumps at random in [1, 4] after every step
    (as rollout.eta=auto may: shrinking at once), publishing at least every η + 1 steps;
    every sample must be within the bound its group was admitted under."""
    from relayrl.sync.weight_sync import publish_interval

    ctrl.start()
    version, slacks, over = 0, [], 0
    try:
        for _ in range(steps):
            batch = await asyncio.wait_for(ctrl.next_batch(), timeout=30)
            for group in batch:
                assert 1 <= group.eta <= 4
                for t in group.trajectories:
                    assert 0 <= t.staleness(version) <= group.eta
                    over += t.staleness(version) > ctrl.eta  # admitted before a shrink
            slacks.append(ctrl.staleness_slack)
            await asyncio.sleep(rng.expovariate(1 / 0.01))
            version += 1
            ctrl.set_eta(rng.randint(1, 4))
            if version - ctrl.published_version >= publish_interval(3, ctrl.eta):
                servers.version = version
                ctrl.set_published_version(version)
    finally:
        await ctrl.stop()
    return slacks, over


def test_a_moving_bound_keeps_every_sample_within_its_admission_bound():
    """Six random trials (B, n, delays, the bound's jumps); over them some samples are
    trained staler than the bound then in force (admitted before a shrink), and none is
    staler than the bound it was admitted under."""
    from tests.rollout.test_controller import FakeReward, FakeServers, make_controller

    over_current = 0
    for trial in range(6):
        rng = random.Random(100 + trial)
        n, b = rng.randint(1, 4), rng.randint(1, 4)
        options = ControllerOptions(
            n_samples=n,
            prompts_per_step=b,
            staleness=StalenessBound(1),
            max_new_tokens=8,
            dynamic_sampling=False,
        )
        servers = FakeServers(rng)
        ctrl = make_controller(servers, options, lambda p, t: FakeReward(1.0))
        slacks, over = asyncio.run(_drive_moving_bound(ctrl, servers, rng, 15))
        assert len(slacks) == 15 and min(slacks) >= 0
        over_current += over
    assert over_current > 0
