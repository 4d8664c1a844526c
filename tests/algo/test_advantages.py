"""Advantages and DAPO helpers against hand-computed values."""

from __future__ import annotations

import math

import pytest

from relayrl.algo.advantages import compute_advantages, dynamic_sampling_keep, overlong_penalty


def test_grpo_uses_group_mean_and_unbiased_std() -> None:
    # mean 0.5, unbiased std sqrt(1/3): ±0.5 / 0.57735 = ±0.8660254
    (adv,) = compute_advantages([[1.0, 0.0, 0.0, 1.0]], "grpo", eps=0.0)
    assert adv == pytest.approx([0.8660254, -0.8660254, -0.8660254, 0.8660254], abs=1e-7)


def test_grpo_eps_and_constant_group() -> None:
    (adv,) = compute_advantages([[2.0, 2.0, 2.0]], "grpo", eps=1e-6)
    assert adv == [0.0, 0.0, 0.0]
    (adv,) = compute_advantages([[1.0, 0.0]], "grpo", eps=0.5)
    # std of [1, 0] (n-1) = 0.70710678; 0.5 / 1.20710678 = 0.41421356
    assert adv == pytest.approx([0.41421356, -0.41421356], abs=1e-7)


def test_drgrpo_subtracts_mean_only() -> None:
    adv = compute_advantages([[1.0, 0.0, 0.0], [3.0, 5.0]], "drgrpo")
    assert adv[0] == pytest.approx([2 / 3, -1 / 3, -1 / 3])
    assert adv[1] == pytest.approx([-1.0, 1.0])


def test_rloo_leave_one_out() -> None:
    adv = compute_advantages([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 1.0], [7.0]], "rloo")
    assert adv[0] == pytest.approx([1.0, -0.5, -0.5])  # 1 − 0, 0 − 1/2
    assert adv[1] == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])  # 1 − 1/3, 0 − 2/3
    assert adv[2] == [0.0]


def test_reinforce_pp_baseline_uses_batch_std() -> None:
    # centred: [0.5, -0.5], [-1, -1, 2]; batch sum of squares 6.5, /4 -> std 1.2747549
    adv = compute_advantages([[1.0, 0.0], [2.0, 2.0, 5.0]], "reinforce_pp_baseline", eps=0.0)
    s = math.sqrt(6.5 / 4)
    assert adv[0] == pytest.approx([0.5 / s, -0.5 / s])
    assert adv[1] == pytest.approx([-1 / s, -1 / s, 2 / s])
    assert adv[0][0] == pytest.approx(0.39223227, abs=1e-7)


def test_unknown_method_and_empty_group() -> None:
    with pytest.raises(ValueError):
        compute_advantages([[1.0]], "ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        compute_advantages([[]], "grpo")


def test_overlong_penalty_dapo_ramp() -> None:
    # max_len 10, buffer 4 -> ramp starts after 6 tokens
    assert overlong_penalty(5, 10, 4, 1.0) == 0.0
    assert overlong_penalty(6, 10, 4, 1.0) == 0.0
    assert overlong_penalty(7, 10, 4, 1.0) == pytest.approx(-0.25)
    assert overlong_penalty(8, 10, 4, 2.0) == pytest.approx(-1.0)
    assert overlong_penalty(10, 10, 4, 1.0) == pytest.approx(-1.0)
    assert overlong_penalty(11, 10, 4, 1.0) == -1.0
    assert overlong_penalty(11, 10, 0, 0.5) == -0.5
    with pytest.raises(ValueError):
        overlong_penalty(5, 10, 11, 1.0)


def test_dynamic_sampling_keep() -> None:
    assert dynamic_sampling_keep([1.0, 0.0, 1.0]) is True
    assert dynamic_sampling_keep([1.0, 1.0, 1.0]) is False
    assert dynamic_sampling_keep([0.0, 0.0]) is False
    assert dynamic_sampling_keep([0.5]) is False
    assert dynamic_sampling_keep([]) is False
    assert dynamic_sampling_keep([0.0, 1e-9], tol=1e-6) is False
