"""Rollout workflows: how one admitted prompt becomes its group of graded samples.

Owns the workflow seam: :class:`RolloutWorkflow` (``run_group``), the request it gets
(:class:`GroupRequest`), the services it may use (:class:`RolloutServices`: generation on
the rollout servers, grading in the pool, the tokenizer), what it returns (:class:`Sample`), the
registry :data:`WORKFLOWS` with :func:`register_workflow`, and the built-ins:
:class:`EpisodeWorkflow` (``episode``, the default: each sample an episode in its problem's
environment, ``relayrl.rollout.environment``; a problem naming none is one completion, so
its group is one batched generate call and one grade call) and :class:`SingleTurnWorkflow`
(``single_turn``: always one turn). ``rollout.workflow=<name>`` selects one
(docs/extending.md, docs/agents.md). The controller around it owns admission under the
staleness bound, reward shaping, filtering and batching, so a workflow cannot break them:
whatever it does, each token it returns carries the weight version and behaviour logprob
the server reported for it.

Imports: the engine's plain types, relayrl.tasks.base, the Trajectory record, the
environment seam, relayrl.registry.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from relayrl.engine.types import SamplingParams
from relayrl.registry import Registry
from relayrl.rollout.environment import (
    Environment,
    Episode,
    SingleTurnEnvironment,
    environment_for,
    run_episode,
    turn_params,
)
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


def _no_text_encoder(text: str) -> list[int]:
    raise RuntimeError(
        "this rollout has no text encoder (RolloutServices.encode_text); an environment "
        f"observation cannot be tokenized: {text[:40]!r}"
    )


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
    """What a workflow may call: the rollout servers (a group's requests in one call, or
    one request: ``generate``, by default a one-sample group), the grading pool, the
    tokenizer (``encode_text``: text → ids without special tokens, for observations)."""

    generate_group: GenerateGroupFn
    score_group: ScoreGroupFn
    decode: Callable[[list[int]], str]
    generate: GenerateFn | None = None
    encode_text: Callable[[str], list[int]] = _no_text_encoder

    async def generate_one(
        self, prompt_ids: list[int], params: SamplingParams, key: str
    ) -> GenerationLike:
        """One request to completion (resubmitted after aborts by the client)."""
        if self.generate is not None:
            return await self.generate(prompt_ids, params, key)
        return (await self.generate_group(prompt_ids, [params], key))[0]


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


class EpisodeWorkflow(RolloutWorkflow):
    """Each sample is an episode in its problem's environment (``relayrl.rollout.environment``;
    a problem naming none is one model turn graded by its grader). Turn 0 of the n samples
    goes out as one batched call (they share the prompt), later turns one request per
    episode as each episode gets there; episodes the environment leaves to the grader are
    graded in one call. A single-turn group is thus exactly one generate and one grade call."""

    name = "episode"

    def environment(self, problem: Problem) -> Environment:
        return environment_for(problem)

    async def run_group(self, request: GroupRequest, services: RolloutServices) -> list[Sample]:
        start = time.perf_counter()
        envs = [self.environment(request.problem) for _ in request.sampling]
        openings = [env.reset(request.problem) for env in envs]
        firsts: Sequence[GenerationLike | None] = [None] * len(envs)
        budget_ok = all(
            len(services.encode_text(o)) < p.max_new_tokens if o else True
            for o, p in zip(openings, request.sampling, strict=True)
        )
        if budget_ok and len(set(openings)) == 1:  # one batched request for turn 0
            prompt = request.prompt_ids + (services.encode_text(openings[0]) if openings[0] else [])
            params = [
                turn_params(env, p, 0, p.max_new_tokens - (len(prompt) - len(request.prompt_ids)))
                for env, p in zip(envs, request.sampling, strict=True)
            ]
            firsts = await services.generate_group(prompt, params, request.key)
        runs = [
            run_episode(
                env,
                request.problem,
                request.prompt_ids,
                params,
                services.generate_one,
                services.encode_text,
                services.decode,
                request.key,
                request.submit_version,
                first=first,
                opening=opening,
            )
            for env, params, first, opening in zip(
                envs, request.sampling, firsts, openings, strict=True
            )
        ]
        if all(first is not None for first in firsts) and all(
            type(env) is SingleTurnEnvironment for env in envs
        ):
            # one-turn episodes whose turn is generated: nothing left that waits, so no
            # task per episode (the single-turn path stays as cheap as a plain request)
            episodes = [await run for run in runs]
        else:  # episodes go on concurrently, each at its own pace
            episodes = await asyncio.gather(*runs)
        generated = time.perf_counter()
        to_grade = [e for e in episodes if e.reward is None]
        if to_grade:
            graded = await services.score_group(request.problem, [e.text for e in to_grade])
            for episode, result in zip(to_grade, graded, strict=True):
                episode.reward, episode.status = float(result.reward), result.status
        timings = {"generate_s": generated - start, "grade_s": time.perf_counter() - generated}
        return [
            Sample(
                trajectory_of_episode(
                    request, j, episode, timings, not isinstance(env, SingleTurnEnvironment)
                ),
                "".join(episode.transcript),
                episode.resubmissions,
            )
            for j, (env, episode) in enumerate(zip(envs, episodes, strict=True))
        ]


class SingleTurnWorkflow(EpisodeWorkflow):
    """One prompt, n completions generated in one batched call, graded in one call:
    every problem as a one-turn episode, whatever environment it names."""

    name = "single_turn"

    def environment(self, problem: Problem) -> Environment:
        return SingleTurnEnvironment()


def trajectory_of_episode(
    request: GroupRequest,
    sample_index: int,
    episode: Episode,
    timings: dict[str, float],
    with_counters: bool = True,
) -> Trajectory:
    """The trajectory of one episode: its tokens by origin, its reward and (``with_counters``:
    not for plain single-turn samples) the episode's counters. ``origins`` stays empty when
    every token is the model's."""
    multi = episode.counters.get("env_tokens", 0) > 0
    return Trajectory(
        prompt_id=request.problem.id,
        group_id=request.key,
        sample_index=sample_index,
        prompt_ids=list(request.prompt_ids),
        completion_ids=episode.completion_ids,
        behav_logprobs=episode.logprobs,
        versions=episode.versions,
        submit_version=request.submit_version,
        finish_reason=episode.finish_reason,
        reward=float(episode.reward or 0.0),
        reward_status=episode.status,
        timings=dict(timings),
        origins=episode.origins if multi else [],
        episode=dict(episode.counters) if with_counters else {},
    )


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


register_workflow(EpisodeWorkflow)
register_workflow(SingleTurnWorkflow)
