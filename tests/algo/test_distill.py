"""On-policy distillation's per-token advantage against hand-computed values."""

from __future__ import annotations

import math

import pytest

from relayrl.algo.advantages import distill_token_advantages
from relayrl.rollout.distill import TEACHER_KL, TEACHER_KL_K3, apply_distillation
from relayrl.rollout.trajectory import ORIGIN_ENV, ORIGIN_MODEL, Trajectory


def test_reverse_kl_reward_added_to_the_task_advantage() -> None:
    student = [math.log(0.5), math.log(0.2), math.log(0.9)]
    teacher = [math.log(0.25), math.log(0.4), math.log(0.9)]
    got = distill_token_advantages([1.0, 1.0, 1.0], student, teacher, [True, True, True], 0.5)
    # −(log μ − log π_T) = log(π_T/μ): log 0.5, log 2, 0; times 0.5, plus A = 1
    assert got == pytest.approx([1 + 0.5 * math.log(0.5), 1 + 0.5 * math.log(2), 1.0])
    only = distill_token_advantages(
        [3.0, -3.0, 3.0], student, teacher, [True, False, True], 1.0, task_weight=0.0
    )
    assert only == pytest.approx([math.log(0.5), 0.0, 0.0])  # the env token gets nothing
    with pytest.raises(ValueError, match="one value per token"):
        distill_token_advantages([1.0], student, teacher, [True] * 3, 1.0)


def test_apply_distillation_uses_per_token_task_advantages_when_present() -> None:
    origins = [ORIGIN_MODEL, ORIGIN_ENV, ORIGIN_MODEL]
    traj = Trajectory("p", "g", 0, [1], [5, 6, 7], [-1.0, 0.0, -2.0], [0] * 3, 0, origins=origins)
    traj.teacher_logprobs = [-0.5, -9.0, -1.0]
    traj.token_advantages = [0.3, 0.0, 0.1]
    apply_distillation([[traj]], coef=2.0, task_weight=1.0)
    assert traj.token_advantages == pytest.approx([0.3 + 2 * 0.5, 0.0, 0.1 + 2 * 1.0])
    assert traj.advantage == pytest.approx((1.3 + 2.1) / 2)
    plain = Trajectory("p", "g", 1, [1], [5], [-1.0], [0], 0)
    plain.advantage = -1.0
    with pytest.raises(ValueError, match="no teacher logprobs"):
        apply_distillation([[plain]], 1.0, 1.0)
    plain.teacher_logprobs = [-3.0]
    apply_distillation([[plain]], 1.0, 0.5)
    assert plain.token_advantages == pytest.approx([-0.5 - 2.0])


def test_the_teacher_kl_metric_by_hand() -> None:
    """Reverse KL(μ ‖ π_T) over the batch's model tokens, k1 and k3, against hand values;
    environment tokens and samples without teacher logprobs do not count."""
    from relayrl.train.metrics import batch_metrics

    a = Trajectory("p", "g", 0, [1], [5, 6], [-1.0, -2.0], [0, 0], 0)
    a.teacher_logprobs = [-1.5, -1.0]  # r = log π_T − log μ = −0.5, +1.0
    origins = [ORIGIN_MODEL, ORIGIN_ENV]
    b = Trajectory("p", "g", 1, [1], [5, 6], [-0.5, 0.0], [0, 0], 0, origins=origins)
    b.teacher_logprobs = [-0.7, -3.0]  # r = −0.2; the environment token is not counted
    got = batch_metrics([a, b])
    assert got[TEACHER_KL] == pytest.approx((0.5 - 1.0 + 0.2) / 3)  # mean of −r: −0.1
    # k3 = mean of e^r − 1 − r: (0.1065307 + 0.7182818 + 0.0187308) / 3
    assert got[TEACHER_KL_K3] == pytest.approx(0.2811811, abs=1e-7)
    assert got[TEACHER_KL_K3] >= 0
    plain = Trajectory("p", "g", 2, [1], [5], [-1.0], [0], 0)
    assert TEACHER_KL not in batch_metrics([plain])  # distillation off: no key
    assert batch_metrics([a, b, plain])[TEACHER_KL] == pytest.approx(-0.1)
