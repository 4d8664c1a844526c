"""On-policy distillation on the rollout side: a teacher server scores each group's
completions, and the batch's advantages get the per-token reverse-KL reward.

Owns: :class:`TeacherScorer` (one ``/generate`` scoring request per group to the teacher,
``relayrl.engine.client.RolloutClient.input_logprobs``), :func:`apply_distillation` (the
batch's per-token advantages, ``relayrl.algo.advantages.distill_token_advantages``) and
:func:`teacher_kl_metrics` (the batch's KL from the student to the teacher). The
teacher is fixed, so its logprobs are fetched once, when a group completes, concurrently
with the rest of the rollout; only the student is stale (η > 0 needs nothing else).

Imports: relayrl.algo.advantages, relayrl.engine.client, the Trajectory record.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from relayrl.algo.advantages import distill_token_advantages
from relayrl.engine.client import RolloutClient
from relayrl.rollout.trajectory import Trajectory


class TeacherScorer:
    """``await scorer(prompt_ids, trajectories, key)`` sets each trajectory's
    ``teacher_logprobs`` from the teacher server at ``url`` (one request per group), under
    the sampling temperature (1 for greedy sampling, the engines' logprob convention)."""

    def __init__(
        self, url: str, temperature: float, timeout_s: float = 600.0, api_key: str | None = None
    ) -> None:
        self.url, self.api_key = url, api_key
        self.temperature = temperature if temperature > 0 else 1.0
        self.timeout_s = timeout_s

    async def __call__(self, prompt_ids: list[int], trajs: Sequence[Trajectory], key: str) -> None:
        async with RolloutClient(self.url, timeout=self.timeout_s, api_key=self.api_key) as client:
            scored = await client.input_logprobs(
                prompt_ids, [t.completion_ids for t in trajs], self.temperature, key
            )
        for traj, logprobs in zip(trajs, scored, strict=True):
            traj.teacher_logprobs = logprobs


def apply_distillation(
    groups: Sequence[Sequence[Trajectory]], coef: float, task_weight: float
) -> None:
    """Replace every sample's advantages by ``task_weight · A + coef · (log π_teacher −
    log μ)`` per model token (``token_advantages``; ``advantage``: their mean over model
    tokens). ``A`` is the sample's task advantage, per token when the estimator gave one."""
    for traj in (t for g in groups for t in g):
        if len(traj.teacher_logprobs) != len(traj.completion_ids):
            raise ValueError(
                f"trajectory {traj.group_id}/{traj.sample_index} has no teacher logprobs"
            )
        n = len(traj.completion_ids)
        base = traj.token_advantages or [traj.advantage] * n
        traj.token_advantages = distill_token_advantages(
            base, traj.behav_logprobs, traj.teacher_logprobs, traj.model_mask, coef, task_weight
        )
        traj.advantage = sum(traj.token_advantages) / max(traj.num_model_tokens, 1)


TEACHER_KL = "distill_teacher_kl"  # mean over model tokens of log μ − log π_T (k1)
TEACHER_KL_K3 = "distill_teacher_kl_k3"  # mean of e^r − 1 − r, r = log π_T − log μ (k3)


def teacher_kl_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """How far the student's samples are from the teacher: two estimates of the reverse KL
    KL(μ ‖ π_T) over every model token of the samples the teacher scored (μ: the policy that
    sampled the token, π_T: the teacher, same temperature), with ``r = log π_T − log μ`` the
    per-token distillation reward. ``distill_teacher_kl`` = mean of ``−r`` (k1: unbiased,
    can be negative on a batch), ``distill_teacher_kl_k3`` = mean of ``e^r − 1 − r`` (k3:
    unbiased and never negative). Falling values mean the student moves towards the
    teacher. Empty when no sample carries teacher logprobs (distillation off)."""
    rewards = [
        t - s
        for traj in trajs
        if traj.teacher_logprobs
        for s, t, on in zip(
            traj.behav_logprobs, traj.teacher_logprobs, traj.model_mask, strict=True
        )
        if on
    ]
    if not rewards:
        return {}
    n = len(rewards)
    return {
        TEACHER_KL: -sum(rewards) / n,
        TEACHER_KL_K3: sum(math.exp(r) - 1.0 - r for r in rewards) / n,
    }
