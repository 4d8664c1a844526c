"""Rollout workflows: how one admitted prompt becomes its group of graded samples.

Owns the workflow seam: :class:`RolloutWorkflow` (``run_group``), the request it gets
(:class:`GroupRequest`), the services it may use (:class:`RolloutServices`: generation on
the rollout servers, grading in the pool, decoding), what it returns (:class:`Sample`), the
registry :data:`WORKFLOWS` with :func:`register_workflow`, and the built-in
:class:`SingleTurnWorkflow` (one prompt → n completions in one batched request → graded in
one call). ``rollout.workflow=<name>`` selects one; a multi-turn or tool-using episode is
another subclass (docs/extending.md). The controller around it owns admission under the
staleness bound, reward shaping, filtering and batching, so a workflow cannot break them:
whatever it does, each token it returns carries the weight version and behaviour logprob
the server reported for it.

Imports: the engine's plain types, relayrl.tasks.base, the Trajectory record, relayrl.registry.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from relayrl.engine.types import SamplingParams
from relayrl.registry import Registry
from relayrl.rollout.trajectory import Trajectory
from relayrl.tasks.base import Problem


class GenerationLike(Protocol):
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: str
    resubmissions: int
    text: str | None  # the server's detokenised output, if it sent one


class RewardLike(Protocol):
    reward: float
    status: str


# a group's n samples in one call: (prompt ids, one SamplingParams per sample, group key)
GenerateGroupFn = Callable[
    [list[int], list[SamplingParams], str], Awaitable[Sequence[GenerationLike]]
]
# a group's completions graded in one call: (problem, texts) -> one reward per text
ScoreGroupFn = Callable[[Problem, list[str]], Awaitable[Sequence[RewardLike]]]
GenerateFn = Callable[[list[int], SamplingParams, str], Awaitable[GenerationLike]]
ScoreFn = Callable[[Problem, str], Awaitable[RewardLike]]


def per_request(generate: GenerateFn) -> GenerateGroupFn:
    """A group generator from a one-request generator: the samples run concurrently."""

    async def generate_group(
        prompt_ids: list[int], params: list[SamplingParams], key: str
    ) -> list[GenerationLike]:
        return list(await asyncio.gather(*(generate(prompt_ids, p, key) for p in params)))

    return generate_group


def per_item(score: ScoreFn) -> ScoreGroupFn:
    """A group scorer from a one-completion scorer: the completions are graded concurrently."""

    async def score_group(problem: Problem, texts: list[str]) -> list[RewardLike]:
        return list(await asyncio.gather(*(score(problem, text) for text in texts)))

    return score_group


@dataclass(frozen=True)
class GroupRequest:
    """One admitted prompt: roll out ``len(sampling)`` samples of it. ``key`` routes every
    request of the group to one server (prefix reuse); ``sampling[j]`` carries sample j's
    seed, so a resumed run generates the same samples."""

    key: str
    problem: Problem
    prompt_ids: list[int]
    submit_version: int
    sampling: list[SamplingParams]


@dataclass(frozen=True)
class RolloutServices:
    """What a workflow may call: the rollout servers, the grading pool, the tokenizer."""

    generate_group: GenerateGroupFn
    score_group: ScoreGroupFn
    decode: Callable[[list[int]], str]


@dataclass
class Sample:
    """One finished sample: its trajectory (reward unshaped: the controller applies the
    run's shaping), its text and how often its request was resubmitted."""

    trajectory: Trajectory
    text: str
    resubmissions: int = 0


class RolloutWorkflow:
    """The seam: subclass, set ``name``, implement ``run_group``, add the class with
    :func:`register_workflow`. Raise to reject the group (it is counted and replaced);
    a :class:`~relayrl.errors.RelayError` or an unreachable server stops the run."""

    name: ClassVar[str]

    async def run_group(self, request: GroupRequest, services: RolloutServices) -> list[Sample]:
        raise NotImplementedError


class SingleTurnWorkflow(RolloutWorkflow):
    """One prompt, n completions generated in one batched call, graded in one call."""

    name = "single_turn"

    async def run_group(self, request: GroupRequest, services: RolloutServices) -> list[Sample]:
        start = time.perf_counter()
        gens = await services.generate_group(request.prompt_ids, request.sampling, request.key)
        generated = time.perf_counter()
        # the server's detokenised text when it has one (saves a decode in this process)
        texts = [
            text
            if (text := getattr(gen, "text", None)) is not None
            else services.decode(gen.output_ids)
            for gen in gens
        ]
        results = await services.score_group(request.problem, texts)
        timings = {"generate_s": generated - start, "grade_s": time.perf_counter() - generated}
        return [
            Sample(trajectory_of(request, j, gen, result, timings), text, gen.resubmissions)
            for j, (gen, result, text) in enumerate(zip(gens, results, texts, strict=True))
        ]


def trajectory_of(
    request: GroupRequest,
    sample_index: int,
    gen: GenerationLike,
    result: RewardLike,
    timings: dict[str, float],
) -> Trajectory:
    """The trajectory of one generation as the server returned it, with its grade."""
    return Trajectory(
        prompt_id=request.problem.id,
        group_id=request.key,
        sample_index=sample_index,
        prompt_ids=list(request.prompt_ids),
        completion_ids=list(gen.output_ids),
        behav_logprobs=list(gen.output_logprobs),
        versions=list(gen.output_versions),
        submit_version=request.submit_version,
        finish_reason=gen.finish_reason,
        reward=float(result.reward),
        reward_status=result.status,
        timings=dict(timings),
    )


WORKFLOWS: Registry[type[RolloutWorkflow]] = Registry("rollout workflow", RolloutWorkflow)


def register_workflow(cls: type[RolloutWorkflow]) -> type[RolloutWorkflow]:
    """Make ``cls`` selectable as ``rollout.workflow=cls.name`` (a class decorator too)."""
    return WORKFLOWS.add_class(cls)


register_workflow(SingleTurnWorkflow)
