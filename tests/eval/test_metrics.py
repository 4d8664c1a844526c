"""Metrics against hand-computed values."""

from __future__ import annotations

import math

import pytest

from relayrl.eval.metrics import (
    maj_at_k,
    majority_answer,
    mean_maj_at_k,
    mean_pass_at_k,
    pass_at_1,
    pass_at_k,
)


def test_pass_at_k_hand_values() -> None:
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    # n=4, c=1, k=1: 1/4
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    # n=10, c=3, k=5: 1 - C(7,5)/C(10,5) = 1 - 21/252
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)
    assert pass_at_k(3, 0, 2) == 0.0
    assert pass_at_k(3, 2, 2) == 1.0  # n - c < k


def test_pass_at_k_matches_binomials_and_is_stable() -> None:
    for n, c, k in [(20, 7, 3), (50, 1, 10), (100, 30, 64)]:
        exact = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12)
    value = pass_at_k(100_000, 3, 1000)  # binomials here have thousands of digits
    assert 0.0 < value < 1.0
    assert value == pytest.approx(1 - (1 - 1000 / 100_000) ** 3, rel=1e-3)


def test_pass_at_k_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_pass_at_1_is_mean_over_samples() -> None:
    correct = [[True, False, False, True], [False] * 4, [True] * 4]
    assert pass_at_1(correct) == pytest.approx((0.5 + 0 + 1) / 3)
    assert mean_pass_at_k(correct, 2) == pytest.approx(((1 - 1 / 6) + 0 + 1) / 3)


def test_majority_vote_and_ties() -> None:
    assert majority_answer(["3", "4", "4", None, None, None]) == ("4", 2)
    # tie 2-2: "5" reached 2 first (sample 3) before "7" (sample 4)
    assert majority_answer(["7", "5", "5", "7"]) == ("5", 2)
    assert majority_answer([None, None]) == (None, 0)
    assert maj_at_k(["7", "5", "5", "7"], [False, True, True, False], 4) is True
    assert maj_at_k(["7", "7", "5"], [False, False, True], 3) is False
    assert maj_at_k(["7", "7", "5"], [False, False, True], 1) is False
    assert maj_at_k([None, None], [False, False], 2) is False
    assert mean_maj_at_k([["1", "1"], ["2", "3"]], [[True, True], [False, True]], 2) == 0.5
