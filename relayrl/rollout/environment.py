"""Environments and episodes: what a multi-turn (tool-using) rollout is made of.

Owns the environment seam: :class:`Environment` (``reset(problem)`` → extra first
observation, async ``step(turn)`` → :class:`StepResult`: observation text, done, reward;
turn and token budgets), the registry :data:`ENVIRONMENTS` with
:func:`register_environment`, :func:`environment_for` (a problem names its environment in
``meta["environment"]``; none means :class:`SingleTurnEnvironment`), and
:func:`run_episode`, the one loop that runs an episode against a generate function (the
rollout servers in training, the in-process engine in evaluation).

Token bookkeeping: model turns are sampled (behaviour logprob and version per token, as the
server reported them, interrupted and resubmitted requests included); observations are
encoded and appended as environment tokens (logprob 0, the version of the model token
before them, origin :data:`~relayrl.rollout.trajectory.ORIGIN_ENV`): prefilled, never
sampled, never trained. Budgets: ``max_turns`` model turns, and the episode's tokens after
the prompt (model + environment) within the request's ``max_new_tokens``; an episode over
either ends with reward 0 and status ``turn_budget`` / ``token_budget``. An environment that
raises ends its episode with reward 0 and status ``env_error``; the run goes on. A turn that
comes back still aborted (the client gave up resubmitting it) ends the episode with status
``aborted`` and finish reason ``abort``: the rollout controller rejects its group.

Imports: the engine's plain types, relayrl.tasks.base, the Trajectory origins, relayrl.registry.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from relayrl.engine.types import SamplingParams
from relayrl.registry import Registry
from relayrl.rollout.trajectory import ORIGIN_ENV, ORIGIN_MODEL
from relayrl.tasks.base import Problem


@dataclass(frozen=True)
class ModelTurn:
    """One model turn as the environment sees it."""

    text: str
    token_ids: list[int]
    finish_reason: str


@dataclass(frozen=True)
class StepResult:
    """What the environment answers to a model turn.

    ``observation`` is appended as environment tokens when the episode goes on. At
    ``done``, ``reward`` is the episode's reward; ``None`` means "grade the model's text
    with the problem's grader" (the grading pool in training). ``metrics`` are summed into
    the episode's counters (e.g. ``tool_calls``)."""

    observation: str = ""
    done: bool = False
    reward: float | None = None
    status: str = "ok"
    metrics: dict[str, float] = field(default_factory=dict)


class Environment:
    """The seam: subclass, set ``name``, implement ``step`` (and ``reset`` if the episode
    needs state or a first observation beyond the prompt), add it with
    :func:`register_environment`; problems whose ``meta["environment"]`` is ``name`` then
    run as its episodes. One instance runs one episode."""

    name: ClassVar[str]
    max_turns: ClassVar[int] = 8  # model turns per episode
    max_turn_tokens: ClassVar[int | None] = None  # tokens per model turn (None: no cap)
    stop: ClassVar[tuple[str, ...]] = ()  # strings that end a model turn (kept in it)

    def reset(self, problem: Problem) -> str:
        """Start an episode of ``problem``; returns text to append to the prompt as the
        environment's first observation ("" for none: the prompt is the observation)."""
        self.problem = problem
        return ""

    async def step(self, turn: ModelTurn) -> StepResult:
        raise NotImplementedError


class SingleTurnEnvironment(Environment):
    """One model turn, graded by the problem's grader: the single-turn rollout."""

    name = "single_turn"
    max_turns = 1

    async def step(self, turn: ModelTurn) -> StepResult:
        return StepResult(done=True)


ENVIRONMENTS: Registry[type[Environment]] = Registry("environment", Environment)


def register_environment(cls: type[Environment]) -> type[Environment]:
    """Make ``cls`` the environment of problems with ``meta["environment"] == cls.name``."""
    return ENVIRONMENTS.add_class(cls)


register_environment(SingleTurnEnvironment)
# the built-in tool environments (relayrl.rollout.tools, which imports this module), named by
# import path: loaded on their first lookup, so this module imports nothing of them
ENVIRONMENTS.add_path("calc", "relayrl.rollout.tools:CalcEnvironment")
ENVIRONMENTS.add_path("python", "relayrl.rollout.tools:PythonEnvironment")


def environment_name(problem: Problem) -> str:
    return str(problem.meta.get("environment") or SingleTurnEnvironment.name)


def environment_for(problem: Problem) -> Environment:
    """A fresh environment for one episode of ``problem``."""
    return ENVIRONMENTS.lookup(environment_name(problem))()


def turn_seed(seed: int | None, turn: int) -> int | None:
    """Seed of model turn ``turn`` of the episode whose request seed is ``seed`` (turn 0
    uses the seed itself, so a one-turn episode samples exactly as a plain request)."""
    if seed is None or turn == 0:
        return seed
    return (seed * 1_000_003 + turn * 104_729 + 7) % (2**63 - 1)


def turn_params(
    env: Environment, base: SamplingParams, turn: int, tokens_left: int
) -> SamplingParams:
    """The sampling parameters of one model turn: the request's, with the turn's seed,
    the environment's stop strings and the budget left."""
    cap = env.max_turn_tokens or tokens_left
    if turn == 0 and not env.stop and min(cap, tokens_left) >= base.max_new_tokens:
        return base  # a plain request (the single-turn case): nothing to change
    return replace(
        base,
        max_new_tokens=max(1, min(cap, tokens_left)),
        seed=turn_seed(base.seed, turn),
        stop=[*base.stop, *env.stop],
    )


# one request to completion (resubmitted after aborts): (ids, params, routing key)
GenerateOne = Callable[[list[int], SamplingParams, str], Awaitable[Any]]


@dataclass
class Episode:
    """A finished episode: every token after the prompt with its origin, logprob and
    version; the model's text (what the grader reads) and the whole transcript."""

    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    origins: list[int] = field(default_factory=list)
    model_text: list[str] = field(default_factory=list)
    transcript: list[str] = field(default_factory=list)
    finish_reason: str = ""
    reward: float | None = None
    status: str = "ok"
    counters: dict[str, float] = field(default_factory=dict)
    resubmissions: int = 0

    def add_model(self, gen: Any, text: str) -> None:
        self.completion_ids += gen.output_ids
        self.logprobs += gen.output_logprobs
        self.versions += gen.output_versions
        self.origins += [ORIGIN_MODEL] * len(gen.output_ids)
        self.model_text.append(text)
        self.transcript.append(text)
        self.resubmissions += int(getattr(gen, "resubmissions", 0))
        self.finish_reason = gen.finish_reason

    def add_env(self, ids: list[int], text: str, version: int) -> None:
        self.completion_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)
        self.origins += [ORIGIN_ENV] * len(ids)
        self.transcript.append(text)
        self.counters["env_tokens"] = self.counters.get("env_tokens", 0.0) + len(ids)

    def count(self, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.counters[key] = self.counters.get(key, 0.0) + float(value)

    def end(self, status: str, reward: float | None) -> Episode:
        self.status, self.reward = status, reward
        return self

    @property
    def text(self) -> str:
        return "".join(self.model_text)


def _last_version(episode: Episode, fallback: int) -> int:
    return episode.versions[-1] if episode.versions else fallback


async def run_episode(
    env: Environment,
    problem: Problem,
    prompt_ids: list[int],
    base: SamplingParams,
    generate: GenerateOne,
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    key: str,
    submit_version: int = 0,
    first: Any | None = None,
    opening: str | None = None,
) -> Episode:
    """Run one episode of ``problem`` in ``env``: model turns generated with ``generate``
    (``first``: turn 0 already generated, e.g. batched with the rest of its group) and the
    environment's observations in between, within the turn budget and the token budget
    ``base.max_new_tokens`` (everything after the prompt); ``opening``: what ``env.reset``
    returned when the caller has reset ``env`` already. See the module docstring."""
    episode = Episode()
    budget = base.max_new_tokens
    if opening is None:
        opening = env.reset(problem)
    if opening:
        ids = encode(opening)
        if len(ids) >= budget:
            return episode.end("token_budget", 0.0)
        episode.add_env(ids, opening, submit_version)
    for turn in range(env.max_turns):
        left = budget - len(episode.completion_ids)
        if left <= 0:
            return episode.end("token_budget", 0.0)
        if turn == 0 and first is not None:
            gen = first
        else:
            params = turn_params(env, base, turn, left)
            gen = await generate(prompt_ids + episode.completion_ids, params, key)
        text = gen.text if getattr(gen, "text", None) is not None else decode(gen.output_ids)
        episode.add_model(gen, text)
        episode.count({"turns": 1})
        if gen.finish_reason == "abort":  # the client gave up resubmitting: rejected later
            return episode.end("aborted", 0.0)
        try:
            result = await env.step(ModelTurn(text, list(gen.output_ids), gen.finish_reason))
        except Exception as exc:  # noqa: BLE001 - a broken environment ends its episode only
            episode.counters["env_errors"] = 1.0
            episode.finish_reason = f"env_error: {type(exc).__name__}"
            return episode.end("env_error", 0.0)
        episode.count(result.metrics)
        if result.done:
            return episode.end(result.status, result.reward)
        if gen.finish_reason == "length" and len(episode.completion_ids) >= budget:
            return episode.end("token_budget", 0.0)
        ids = encode(result.observation)
        if len(episode.completion_ids) + len(ids) >= budget:
            return episode.end("token_budget", 0.0)
        episode.add_env(ids, result.observation, _last_version(episode, submit_version))
    return episode.end("turn_budget", 0.0)


def episode_means(counters: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per counter (turns, tool calls, ...): its mean over episodes and, for counters other
    than ``turns``, the share of episodes where it is positive (``<name>_rate``)."""
    keys = sorted({k for c in counters for k in c})
    n = max(len(counters), 1)
    out: dict[str, float] = {}
    for key in keys:
        values = [c.get(key, 0.0) for c in counters]
        out[key] = sum(values) / n
        if key != "turns":
            out[f"{key}_rate"] = sum(v > 0 for v in values) / n
    return out
