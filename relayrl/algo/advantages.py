"""Outcome advantages from group rewards, and DAPO's reward shaping helpers.

Owns: the advantage-estimator seam (:class:`AdvantageEstimator`, :data:`ADVANTAGES`,
:func:`register_advantage`, an estimator's own parameters a ``Params`` model on its class as
for a loss; built in: GRPO, Dr.GRPO, RLOO, REINFORCE++-baseline and REINFORCE++),
``compute_advantages``, ``compute_token_advantages``, on-policy distillation's per-token
advantage (``distill_token_advantages``), the DAPO soft overlong penalty and the DAPO
dynamic-sampling test. Everything here works on plain Python floats: a group is the list
of rewards of the completions of one prompt, and an advantage is one number per completion
(the trainer broadcasts it over the completion's tokens) or, for a ``per_token`` estimator
(REINFORCE++'s discounted returns), one number per completion token.

Advantages are computed once per training batch, by the rollout controller as it hands the
batch out, before any selection or replay, so dropping samples later never changes a group's
statistics (see docs/architecture.md, "Trajectory").

Imports: the standard library, relayrl.registry and relayrl.algo.params (torch is not
needed for this arithmetic).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

from relayrl.algo.params import Objective, ObjectiveParams
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


class AdvantageEstimator(Objective):
    """The seam for advantage estimators: subclass, set ``name``, implement ``compute``, add
    the class with :func:`register_advantage`; ``algo.advantage=<name>`` then selects it.
    Its own parameters are a nested ``class Params(ObjectiveParams)``
    (``relayrl.algo.params``): each field is the config key ``algo.<field>``, and
    ``compute`` reads ``self.params``.

    ``compute`` sees the rewards of a whole training batch (one list per group) and returns
    one advantage per sample, same nesting; the rollout controller calls it once per batch,
    so per-group and batch-level baselines are the same kind of thing.

    A ``per_token`` estimator implements ``compute_tokens`` instead: it also sees each
    sample's trained-token mask (``Trajectory.model_mask``) and the discount ``gamma``
    (``algo.gamma``) and returns one advantage per completion token (0 where the mask is
    false)."""

    name: ClassVar[str]
    per_token: ClassVar[bool] = False

    def compute(self, rewards_by_group: Sequence[Sequence[float]], eps: float) -> list[list[float]]:
        raise NotImplementedError

    def compute_tokens(
        self,
        rewards_by_group: Sequence[Sequence[float]],
        masks_by_group: Sequence[Sequence[Sequence[bool]]],
        eps: float,
        gamma: float,
    ) -> list[list[list[float]]]:
        """Per-token advantages; by default each sample's ``compute`` value on its masked
        tokens."""
        del gamma
        per_sample = self.compute(rewards_by_group, eps)
        return [
            [[a if on else 0.0 for on in mask] for a, mask in zip(advs, masks, strict=True)]
            for advs, masks in zip(per_sample, masks_by_group, strict=True)
        ]


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


def _discounted_returns(reward: float, mask: Sequence[bool], gamma: float) -> list[float]:
    """``G_t = γ^{k_t} · R`` for an outcome reward R at the last trained token, ``k_t`` the
    number of trained tokens after t; 0 on the untrained (environment) tokens."""
    out, k = [0.0] * len(mask), 0
    for t in range(len(mask) - 1, -1, -1):
        if mask[t]:
            out[t] = reward * gamma**k
            k += 1
    return out


class ReinforcePP(AdvantageEstimator):
    """REINFORCE++ without a baseline (verl's ``reinforce_plus_plus``): each trained token's
    discounted return ``G_t = γ^{k_t}·R`` (the outcome reward R at the last token), whitened
    over every trained token of the batch: ``(G_t − mean) / (std + eps)`` (unbiased std)."""

    name = "reinforce_pp"
    per_token = True

    def compute(self, rewards_by_group: Sequence[Sequence[float]], eps: float) -> list[list[float]]:
        raise ValueError(
            "reinforce_pp gives per-token advantages: call compute_token_advantages "
            "with the samples' token masks"
        )

    def compute_tokens(
        self,
        rewards_by_group: Sequence[Sequence[float]],
        masks_by_group: Sequence[Sequence[Sequence[bool]]],
        eps: float,
        gamma: float,
    ) -> list[list[list[float]]]:
        returns = [
            [_discounted_returns(r, mask, gamma) for r, mask in zip(rs, ms, strict=True)]
            for rs, ms in zip(rewards_by_group, masks_by_group, strict=True)
        ]
        trained = [
            g
            for group, masks in zip(returns, masks_by_group, strict=True)
            for sample, mask in zip(group, masks, strict=True)
            for g, on in zip(sample, mask, strict=True)
            if on
        ]
        if not trained:
            return returns
        m, s = _mean(trained), _std(trained)
        return [
            [
                [(g - m) / (s + eps) if on else 0.0 for g, on in zip(sample, mask, strict=True)]
                for sample, mask in zip(group, masks, strict=True)
            ]
            for group, masks in zip(returns, masks_by_group, strict=True)
        ]


ADVANTAGES: Registry[type[AdvantageEstimator]] = Registry("advantage method", AdvantageEstimator)


def register_advantage(cls: type[AdvantageEstimator]) -> type[AdvantageEstimator]:
    """Make ``cls`` selectable as ``algo.advantage=cls.name`` (usable as a class decorator)."""
    return ADVANTAGES.add_class(cls)


for _builtin in (GRPO, DrGRPO, RLOO, ReinforcePPBaseline, ReinforcePP):
    register_advantage(_builtin)


def advantage_estimator(name: str, params: ObjectiveParams | None = None) -> AdvantageEstimator:
    """An instance of the registered estimator ``name`` with its own ``params`` (None: the
    defaults of its ``Params``); a ``ValueError`` lists the known names."""
    return ADVANTAGES.lookup(name)(params)


def compute_advantages(
    rewards_by_group: Sequence[Sequence[float]],
    method: str,
    eps: float = 1e-6,
    params: ObjectiveParams | None = None,
) -> list[list[float]]:
    """Per-sample advantages, same nesting as ``rewards_by_group``, by the registered
    estimator ``method`` (built in: ``grpo``, ``drgrpo``, ``rloo``,
    ``reinforce_pp_baseline``; see each class; ``reinforce_pp`` is per token, see
    ``compute_token_advantages``) with its own ``params``. Pass the whole step's groups:
    batch-level estimators need them.

    Standard deviations are unbiased (divide by n − 1, as ``torch.std`` in TRL and verl);
    a group of one sample gets advantage 0 under every built-in method.
    """
    estimator = advantage_estimator(method, params)
    if any(len(g) == 0 for g in rewards_by_group):
        raise ValueError("every group needs at least one reward")
    advantages = estimator.compute(rewards_by_group, eps)
    if [len(a) for a in advantages] != [len(g) for g in rewards_by_group]:
        raise ValueError(f"advantage estimator {method!r} returned the wrong shape")
    return advantages


def compute_token_advantages(
    rewards_by_group: Sequence[Sequence[float]],
    masks_by_group: Sequence[Sequence[Sequence[bool]]],
    method: str,
    eps: float = 1e-6,
    gamma: float = 1.0,
    params: ObjectiveParams | None = None,
) -> list[list[list[float]]]:
    """Per-token advantages (one list per sample, one value per completion token, 0 where
    the sample's mask is false) by the registered estimator ``method`` with its own
    ``params``; a per-sample estimator's value is broadcast over the sample's masked
    tokens."""
    if [len(m) for m in masks_by_group] != [len(g) for g in rewards_by_group]:
        raise ValueError("masks_by_group must have one mask per reward")
    if any(len(g) == 0 for g in rewards_by_group):
        raise ValueError("every group needs at least one reward")
    estimator = advantage_estimator(method, params)
    out = estimator.compute_tokens(rewards_by_group, masks_by_group, eps, gamma)
    shape = [[len(m) for m in ms] for ms in masks_by_group]
    if [[len(a) for a in g] for g in out] != shape:
        raise ValueError(f"advantage estimator {method!r} returned the wrong shape")
    return out


def distill_token_advantages(
    advantages: Sequence[float],
    student_logprobs: Sequence[float],
    teacher_logprobs: Sequence[float],
    mask: Sequence[bool],
    coef: float,
    task_weight: float = 1.0,
) -> list[float]:
    """On-policy distillation (reverse KL): per trained token
    ``task_weight · A_t + coef · (log π_teacher(y_t) − log π_student(y_t))``, 0 elsewhere.

    ``student_logprobs`` are the sampler's (the behaviour logprobs μ of the sampled tokens),
    so ``−(log μ − log π_teacher)`` is a one-sample estimate of the per-token reverse KL
    KL(μ ‖ π_teacher) at that prefix; ``advantages`` the task advantage of every token."""
    n = len(mask)
    if not len(advantages) == len(student_logprobs) == len(teacher_logprobs) == n:
        raise ValueError(
            f"distillation needs one value per token: {len(advantages)} advantages, "
            f"{len(student_logprobs)} student and {len(teacher_logprobs)} teacher logprobs, "
            f"{n} tokens"
        )
    return [
        task_weight * a + coef * (t - s) if on else 0.0
        for a, s, t, on in zip(advantages, student_logprobs, teacher_logprobs, mask, strict=True)
    ]


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
