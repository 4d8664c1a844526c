"""Outcome advantages from group rewards, and DAPO's reward shaping helpers.

Owns: the advantage-estimator seam (:class:`AdvantageEstimator`, :data:`ADVANTAGES`,
:func:`register_advantage`; built in: GRPO, Dr.GRPO, RLOO, REINFORCE++-baseline),
``compute_advantages``, the DAPO soft overlong penalty and the DAPO dynamic-sampling test. Everything here works on plain Python
floats: a group is the list of rewards of the completions of one prompt, and an advantage is
one number per completion (the trainer broadcasts it over the completion's tokens).

Advantages are computed once per training batch, by the rollout controller as it hands the
batch out, before any selection or replay, so dropping samples later never changes a group's
statistics (see docs/architecture.md, "Trajectory").

Imports: the standard library and relayrl.registry (torch is not needed for this arithmetic).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

from relayrl.registry import Registry


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _std(xs: Sequence[float]) -> float:
    """Unbiased (n − 1) standard deviation, as ``torch.std``; 0 for fewer than 2 values."""
    n = len(xs)
    if n < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))


def _grpo(group: Sequence[float], eps: float) -> list[float]:
    m, s = _mean(group), _std(group)
    return [(r - m) / (s + eps) for r in group]


def _drgrpo(group: Sequence[float]) -> list[float]:
    m = _mean(group)
    return [r - m for r in group]


def _rloo(group: Sequence[float]) -> list[float]:
    """r_i − mean_{j≠i} r_j = n/(n−1) · (r_i − mean); a lone sample gets 0."""
    n = len(group)
    if n < 2:
        return [0.0] * n
    total = sum(group)
    return [r - (total - r) / (n - 1) for r in group]


def _reinforce_pp_baseline(groups: Sequence[Sequence[float]], eps: float) -> list[list[float]]:
    """Subtract each group's mean, then divide by the std of those centred values over the
    whole batch (one value per sample, unbiased)."""
    centred = [_drgrpo(g) for g in groups]
    s = _std([a for g in centred for a in g])
    return [[a / (s + eps) for a in g] for g in centred]


class AdvantageEstimator:
    """The seam for advantage estimators: subclass, set ``name``, implement ``compute``, add
    the class with :func:`register_advantage`; ``algo.advantage=<name>`` then selects it.

    ``compute`` sees the rewards of a whole training batch (one list per group) and returns
    one advantage per sample, same nesting; the rollout controller calls it once per batch,
    so per-group and batch-level baselines are the same kind of thing."""

    name: ClassVar[str]

    def compute(self, rewards_by_group: Sequence[Sequence[float]], eps: float) -> list[list[float]]:
        raise NotImplementedError


class GRPO(AdvantageEstimator):
    """``(r − mean_g) / (std_g + eps)``."""

    name = "grpo"

    def compute(self, rewards_by_group: Sequence[Sequence[float]], eps: float) -> list[list[float]]:
        return [_grpo(g, eps) for g in rewards_by_group]


class DrGRPO(AdvantageEstimator):
    """``r − mean_g`` (Dr.GRPO: no std; pair it with ``seq_sum`` aggregation)."""

    name = "drgrpo"

    def compute(self, rewards_by_group: Sequence[Sequence[float]], eps: float) -> list[list[float]]:
        return [_drgrpo(g) for g in rewards_by_group]


class RLOO(AdvantageEstimator):
    """``r_i − mean_{j≠i} r_j`` (leave-one-out baseline)."""

    name = "rloo"

    def compute(self, rewards_by_group: Sequence[Sequence[float]], eps: float) -> list[list[float]]:
        return [_rloo(g) for g in rewards_by_group]


class ReinforcePPBaseline(AdvantageEstimator):
    """``(r − mean_g) / (std_batch + eps)``, the std over the centred values of every sample
    in the batch."""

    name = "reinforce_pp_baseline"

    def compute(self, rewards_by_group: Sequence[Sequence[float]], eps: float) -> list[list[float]]:
        return _reinforce_pp_baseline(rewards_by_group, eps)


ADVANTAGES: Registry[type[AdvantageEstimator]] = Registry("advantage method", AdvantageEstimator)


def register_advantage(cls: type[AdvantageEstimator]) -> type[AdvantageEstimator]:
    """Make ``cls`` selectable as ``algo.advantage=cls.name`` (usable as a class decorator)."""
    return ADVANTAGES.add_class(cls)


for _builtin in (GRPO, DrGRPO, RLOO, ReinforcePPBaseline):
    register_advantage(_builtin)


def advantage_estimator(name: str) -> AdvantageEstimator:
    """An instance of the registered estimator ``name``; a ``ValueError`` lists the known."""
    return ADVANTAGES.lookup(name)()


def compute_advantages(
    rewards_by_group: Sequence[Sequence[float]],
    method: str,
    eps: float = 1e-6,
) -> list[list[float]]:
    """Per-sample advantages, same nesting as ``rewards_by_group``, by the registered
    estimator ``method`` (built in: ``grpo``, ``drgrpo``, ``rloo``,
    ``reinforce_pp_baseline``; see each class). Pass the whole step's groups: batch-level
    estimators need them.

    Standard deviations are unbiased (divide by n − 1, as ``torch.std`` in TRL and verl);
    a group of one sample gets advantage 0 under every built-in method.
    """
    estimator = advantage_estimator(method)
    if any(len(g) == 0 for g in rewards_by_group):
        raise ValueError("every group needs at least one reward")
    advantages = estimator.compute(rewards_by_group, eps)
    if [len(a) for a in advantages] != [len(g) for g in rewards_by_group]:
        raise ValueError(f"advantage estimator {method!r} returned the wrong shape")
    return advantages


def overlong_penalty(length: int, max_len: int, buffer_len: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment, a value (≤ 0) to add to the reward.

    With ``L_exp = max_len − buffer_len``: 0 when ``length ≤ L_exp``; a linear ramp
    ``(L_exp − length) / buffer_len · penalty`` inside the last ``buffer_len`` tokens; and
    ``−penalty`` beyond ``max_len``. ``buffer_len = 0`` gives a hard cut at ``max_len``.
    """
    if not 0 <= buffer_len <= max_len:
        raise ValueError(f"need 0 <= buffer_len ({buffer_len}) <= max_len ({max_len})")
    if penalty < 0:
        raise ValueError("penalty is a magnitude and must be >= 0")
    expected = max_len - buffer_len
    if length <= expected:
        return 0.0
    if length <= max_len:
        return (expected - length) / buffer_len * penalty
    return -penalty


def dynamic_sampling_keep(rewards: Sequence[float], tol: float = 0.0) -> bool:
    """DAPO dynamic sampling: keep a group only if its rewards are not all equal.

    A group whose rewards are all equal (within ``tol``) has zero advantage everywhere and
    gives no gradient; the rollout controller drops it and admits a replacement prompt.
    """
    if len(rewards) == 0:
        return False
    return max(rewards) - min(rewards) > tol
