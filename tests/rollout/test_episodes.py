"""Multi-turn episodes through the workflow and the controller, against a fake policy server
(text per turn from a script or a seeded choice; tokens versioned like the servers do) and
tools with random latencies: the staleness bound over episodes, bad tool calls and budgets
recorded as rewards and counters while the run goes on, resume of in-flight episodes,
the single-turn special case, the calc and sandboxed python tools."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, replace

import pytest

from relayrl.engine.types import SamplingParams
from relayrl.rewards.sandbox import SandboxLimits
from relayrl.rollout.controller import ControllerOptions, RolloutController
from relayrl.rollout.environment import (
    Environment,
    ModelTurn,
    StepResult,
    register_environment,
)
from relayrl.rollout.eta import StalenessBound
from relayrl.rollout.prompts import PromptLoader
from relayrl.rollout.tools import (
    CalcEnvironment,
    PythonEnvironment,
    ToolEnvironment,
    ToolError,
    calc,
    calc_value,
    run_python,
)
from relayrl.rollout.trajectory import ORIGIN_ENV, ORIGIN_MODEL
from relayrl.rollout.workflow import (
    EpisodeWorkflow,
    GroupRequest,
    RolloutServices,
    SingleTurnWorkflow,
    per_item,
    per_request,
)
from relayrl.tasks.base import Problem
from tests.rollout.test_controller import drive


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(map(chr, ids))


@dataclass
class Gen:
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: str = "stop"
    resubmissions: int = 0
    text: str | None = None


class FakePolicy:
    """A rollout server whose turn text is ``meta["script"][turn]`` (turn = observations in
    the context so far) or, without a script, a seeded pick among ``choices``; its tokens
    get the server version current when each half of the turn is produced."""

    choices = ("<calc>3*4</calc>", "#### 12", "#### 11", "<calc>2+2</calc>")

    def __init__(self, rng: random.Random, scripts: dict[str, list[str]] | None = None) -> None:
        self.rng, self.scripts, self.version, self.calls = rng, scripts or {}, 0, 0

    async def generate(self, ids: list[int], params: SamplingParams, key: str) -> Gen:
        self.calls += 1
        context = decode(ids)
        turn = context.count("<out>")
        script = self.scripts.get(context.split("|")[0])
        if script is not None:
            text = script[min(turn, len(script) - 1)]
        else:
            text = random.Random(params.seed).choice(self.choices)
        text = text[: params.max_new_tokens]
        n = len(text)
        await asyncio.sleep(self.rng.expovariate(1 / 0.003))
        first = [self.version] * (n // 2)
        await asyncio.sleep(self.rng.expovariate(1 / 0.003))
        versions = first + [self.version] * (n - n // 2)
        reason = "length" if n == params.max_new_tokens else "stop"
        return Gen(encode(text), [-0.25] * n, versions, reason)


async def grade(problem: Problem, text: str):
    @dataclass
    class R:
        reward: float
        status: str = "ok"

    said = text.rsplit("####", 1)[-1].strip() if "####" in text else None
    return R(float(said == problem.answer))


_latency = random.Random(7)


async def slow_calc(expression: str) -> str:
    await asyncio.sleep(_latency.expovariate(1 / 0.01))  # a tool with random latency
    return calc_value(expression)


@register_environment
class SlowCalc(ToolEnvironment):
    name = "test_slow_calc"
    tools = {"calc": slow_calc}


async def crash(argument: str) -> str:
    raise RuntimeError("tool crashed")


async def hang(argument: str) -> str:
    await asyncio.sleep(3600)
    return ""


@register_environment
class Flaky(ToolEnvironment):
    name = "test_flaky"
    tools = {"calc": calc, "crash": crash, "hang": hang}
    tool_timeout_s = 0.05
    max_turns = 3


@register_environment
class Broken(Environment):
    name = "test_broken"

    async def step(self, turn: ModelTurn) -> StepResult:
        raise KeyError("environment bug")


def problems(n: int, env: str, prefix: str = "p") -> list[Problem]:
    return [
        Problem(f"{prefix}{i}", f"{prefix}{i}|", "12", "math", {"environment": env})
        for i in range(n)
    ]


def services_for(policy: FakePolicy) -> RolloutServices:
    return RolloutServices(
        generate_group=per_request(policy.generate),
        score_group=per_item(grade),
        decode=decode,
        generate=policy.generate,
        encode_text=encode,
    )


def controller(policy: FakePolicy, probs, eta: int, max_new_tokens: int = 200, **kw):
    options = ControllerOptions(
        n_samples=4,
        prompts_per_step=3,
        staleness=StalenessBound(eta),
        max_new_tokens=max_new_tokens,
        **{"dynamic_sampling": False, **kw},
    )
    return RolloutController(
        PromptLoader(probs, seed=1),
        options,
        per_request(policy.generate),
        per_item(grade),
        encode=lambda p: encode(p.prompt),
        decode=decode,
        generate=policy.generate,
        encode_text=encode,
    )


async def train_fake(ctrl, policy, steps: int, eta: int, rng, first_version: int = 0):
    """The controller tests' fake trainer (staleness and admission bounds checked at every
    step, publication on the training loop's schedule) over episodes. Returns the batches."""
    batches: list = []
    await drive(ctrl, policy, steps, eta, rng, 1, first_version, batches)
    return batches


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_staleness_bound_holds_over_episodes_with_random_tool_latency(eta):
    rng = random.Random(eta)
    policy = FakePolicy(rng)
    ctrl = controller(policy, problems(40, SlowCalc.name), eta)
    batches = asyncio.run(train_fake(ctrl, policy, 12, eta, rng))
    trajs = [t for b in batches for g in b for t in g.trajectories]
    multi = [t for t in trajs if t.episode.get("turns", 0) > 1]
    assert multi, "no multi-turn episode: the test would prove nothing"
    if eta > 0:  # episodes whose turns ran under different weights exist, still within η
        assert any(len(set(t.versions)) > 1 for t in multi)
    for t in trajs:
        env = [i for i, o in enumerate(t.origins) if o == ORIGIN_ENV]
        assert all(t.behav_logprobs[i] == 0.0 for i in env)
        assert all(t.versions[i] == t.versions[i - 1] for i in env)  # the turn before's
        tool_calls = decode(t.completion_ids).count("<out>")
        assert t.episode.get("tool_calls", 0) == tool_calls
        assert t.reward == float(decode(t.completion_ids).rstrip().endswith("#### 12"))


def run_group(policy, problem, max_new_tokens=200, n=1, workflow=None):
    request = GroupRequest(
        "g0",
        problem,
        encode(problem.prompt),
        submit_version=0,
        sampling=[SamplingParams(max_new_tokens=max_new_tokens, seed=j) for j in range(n)],
    )
    return asyncio.run((workflow or EpisodeWorkflow()).run_group(request, services_for(policy)))


BAD = {
    "unclosed": (["<calc>3*4", "#### 12"], "error: unclosed <calc>"),
    "unknown_tool": (["<shell>ls</shell>", "#### 12"], "error: unknown tool <shell>"),
    "bad_syntax": (["<calc>__import__('os')</calc>", "#### 12"], "error: unsupported syntax"),
    "crash": (["<crash>x</crash>", "#### 12"], "error: crash failed: RuntimeError"),
    "hang": (["<hang>x</hang>", "#### 12"], "error: hang timed out after 0.05s"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_tool_call_is_an_error_observation_and_the_episode_goes_on(case):
    script, expected = BAD[case]
    problem = problems(1, Flaky.name, prefix=case)[0]
    (sample,) = run_group(FakePolicy(random.Random(0), {f"{case}0": script}), problem)
    t = sample.trajectory
    observation = decode(
        [c for c, o in zip(t.completion_ids, t.origins, strict=True) if o == ORIGIN_ENV]
    )
    assert observation.startswith(f"<out>{expected}")
    assert t.episode["tool_errors"] == 1 and t.episode["turns"] == 2
    assert t.episode.get("malformed_calls", 0) == (case in ("unclosed", "unknown_tool"))
    assert t.reward == 1.0 and t.reward_status == "ok"  # it answered right after the error


def test_budgets_and_a_broken_environment_end_the_episode_with_reward_zero():
    loop_forever = problems(1, Flaky.name, prefix="loop")[0]
    policy = FakePolicy(
        random.Random(0), {"loop0": ["<calc>1+1</calc>"], "big0": ["<calc>9**59</calc>"]}
    )
    (turns,) = run_group(policy, loop_forever)
    assert turns.trajectory.reward_status == "turn_budget" and turns.trajectory.reward == 0.0
    assert turns.trajectory.episode["turns"] == Flaky.max_turns
    big = problems(1, Flaky.name, prefix="big")[0]
    (tokens,) = run_group(policy, big, max_new_tokens=60)
    t = tokens.trajectory
    assert t.reward_status == "token_budget" and t.reward == 0.0 and len(t.completion_ids) < 60
    (broken,) = run_group(policy, problems(1, Broken.name, prefix="x")[0])
    assert broken.trajectory.reward_status == "env_error" and broken.trajectory.reward == 0.0
    assert broken.trajectory.finish_reason == "env_error: KeyError"


def test_the_run_goes_on_through_bad_episodes_and_counts_them():
    rng = random.Random(3)
    scripts = {
        f"m{i}": [["<calc>1+1</calc>"], ["<hang>x</hang>", "#### 12"], ["#### 12"]][i % 3]
        for i in range(30)
    }
    policy = FakePolicy(rng, scripts)
    probs = problems(30, Flaky.name, prefix="m") + problems(6, Broken.name, prefix="b")
    ctrl = controller(policy, probs, eta=1, dynamic_sampling=False)
    batches = asyncio.run(train_fake(ctrl, policy, 8, 1, rng))
    assert len(batches) == 8
    for status in ("turn_budget", "env_error", "ok"):
        assert ctrl.counters[f"reward_{status}"] > 0, dict(ctrl.counters)
    assert ctrl.counters["rejected_error"] == 0


class Gate:
    """Holds tool calls while closed, so a test can snapshot episodes that are certainly
    waiting on a tool (whatever the machine's speed); counts the calls it holds."""

    open, waiting = True, 0

    @classmethod
    async def calc(cls, expression: str) -> str:
        cls.waiting += 1
        try:
            while not cls.open:
                await asyncio.sleep(0.001)
        finally:
            cls.waiting -= 1
        return calc_value(expression)


@register_environment
class GatedCalc(ToolEnvironment):
    name = "test_gated_calc"
    tools = {"calc": Gate.calc}


async def wait_for(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        await asyncio.sleep(0.001)


def test_resume_mid_episode_loses_and_duplicates_no_episode():
    """Checkpoint the controller while episodes are between turns (a tool call held open),
    stop it (as kill -9 would, after that checkpoint), restore a new one: every admitted
    group is trained exactly once, in admission order, and a regenerated in-flight episode
    is the episode the same seeds give."""
    rng = random.Random(5)
    probs = problems(60, GatedCalc.name)

    async def first_part():
        policy = FakePolicy(rng)
        ctrl = controller(policy, probs, eta=2)
        ctrl.start()
        trained = [await ctrl.next_batch() for _ in range(2)]
        Gate.open = False  # from here on every tool call waits
        policy.version = 1
        ctrl.set_published_version(1)  # the bound moves up: new groups are admitted
        await wait_for(lambda: Gate.waiting > 0, "an episode waiting on its tool")
        state = ctrl.state_dict()
        await ctrl.stop()
        return trained, state

    try:
        trained, state = asyncio.run(first_part())
    finally:
        Gate.open = True
    assert any(e["status"] == "running" for e in state["pending"])
    policy = FakePolicy(rng)
    policy.version = 2
    resumed = controller(policy, probs, eta=2)
    resumed.load_state_dict(state)
    resumed.published_version = 2
    rest = asyncio.run(train_fake(resumed, policy, 4, 2, rng, first_version=2))
    order = [g.index for batch in trained + rest for g in batch]
    assert order == list(range(len(order)))
    prompts = [g.prompt_index for batch in trained + rest for g in batch]
    assert len(set(prompts)) == len(prompts)
    # a regenerated episode is the one its seeds give (the fake policy is seeded per turn)
    again = controller(FakePolicy(random.Random(0)), probs, eta=2)
    group = rest[0][0]
    regenerated = asyncio.run(again._generate_and_grade(group))
    assert [t.completion_ids for t, _ in regenerated] == [
        t.completion_ids for t in group.trajectories
    ]


def test_single_turn_is_the_one_turn_episode():
    """A problem naming no environment: one batched generate, one grade, no origins or
    counters recorded (the trajectory is what the single-turn path always produced)."""
    policy = FakePolicy(random.Random(0), {"s0": ["#### 12"]})
    problem = Problem("s0", "s0|", "12", "math")
    samples = run_group(policy, problem, n=3)
    assert policy.calls == 3 and all(s.trajectory.reward == 1.0 for s in samples)
    assert all(s.trajectory.origins == [] and s.trajectory.episode == {} for s in samples)
    tool_problem = problems(1, CalcEnvironment.name, prefix="s")[0]
    policy = FakePolicy(random.Random(0), {"s0": ["<calc>3*4</calc>", "#### 12"]})
    (forced,) = run_group(policy, tool_problem, workflow=SingleTurnWorkflow())
    assert forced.trajectory.origins == [] and policy.calls == 1
    assert forced.trajectory.reward == 0.0  # no answer in its one turn


def test_calc_evaluates_arithmetic_and_refuses_anything_else():
    assert calc_value("347*68") == "23596"
    assert calc_value(" (2+3)**2 - 10/4 ") == "22.5"
    assert calc_value("2**10/4") == "256"
    for bad in ("__import__('os')", "x+1", "9**99", "1/0", "10**59*10**59", "1+"):
        with pytest.raises(ToolError):
            calc_value(bad)


def test_python_tool_runs_in_the_sandbox_and_reports_failures():
    assert asyncio.run(run_python("print(6*7)")) == "42"
    with pytest.raises(ToolError, match="exit 1: ZeroDivisionError"):
        asyncio.run(run_python("1/0"))
    quick = SandboxLimits(wall_s=0.5, cpu_s=1, memory_mb=128)
    with pytest.raises(ToolError, match="timed out after 0.5s"):
        asyncio.run(run_python("while True: pass", quick))
    result = asyncio.run(PythonEnvironment().step(ModelTurn("<python>1/0</python>", [], "stop")))
    assert result.observation.startswith("<out>error: exit 1: ZeroDivisionError")
    assert not result.done and result.metrics["tool_errors"] == 1


def test_a_turn_still_aborted_ends_the_episode_for_rejection():
    """A later turn that the client gave up resubmitting ends the episode there, marked
    ``abort``: no observation is appended after it and nothing grades it (the controller
    then rejects the group, tests/rollout/test_controller.py)."""
    policy = FakePolicy(random.Random(0), {"cut0": ["<calc>3*4</calc>", "#### 12"]})

    async def cut_second_turn(ids, params, key):
        gen = await policy.generate(ids, params, key)
        if decode(ids).count("<out>") == 1:
            gen.finish_reason, gen.resubmissions = "abort", 32
        return gen

    services = replace(services_for(policy), generate=cut_second_turn)
    problem = problems(1, Flaky.name, prefix="cut")[0]
    request = GroupRequest(
        "g0", problem, encode(problem.prompt), 0, [SamplingParams(max_new_tokens=200, seed=0)]
    )
    (sample,) = asyncio.run(EpisodeWorkflow().run_group(request, services))
    t = sample.trajectory
    assert (t.finish_reason, t.reward_status, t.reward) == ("abort", "aborted", 0.0)
    assert t.episode["turns"] == 2 and t.origins[-1] == ORIGIN_MODEL
    assert sample.resubmissions == 32
