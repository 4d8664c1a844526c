"""The complete example of docs/agents.md, run as written: its environment and task are
registered, and a bisecting policy (a fake server reading the hints) solves every episode
in at most seven turns, with one hint per wrong guess; a malformed turn is answered."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from types import ModuleType

from relayrl.engine.types import SamplingParams
from relayrl.rollout.environment import ENVIRONMENTS, ModelTurn
from relayrl.rollout.workflow import EpisodeWorkflow, GroupRequest, RolloutServices
from relayrl.tasks.registry import make_task
from tests.doc_examples import doc_example, import_doc_example
from tests.rollout.test_episodes import Gen, decode, encode

SECTION = "## A complete example"


def load_example(tmp_path: Path) -> ModuleType:
    assert len(doc_example("agents.md", SECTION).splitlines()) < 60
    return import_doc_example("agents.md", SECTION, tmp_path, "agents_example")


async def bisect(ids: list[int], params: SamplingParams, key: str) -> Gen:
    """Guess the middle of the interval the hints so far leave open."""
    low, high = 0, 99
    for guess, hint in re.findall(r"<guess>(\d+)</guess> (higher|lower)", decode(ids)):
        low, high = (int(guess) + 1, high) if hint == "higher" else (low, int(guess) - 1)
    text = f"<guess>{(low + high) // 2}</guess>"
    return Gen(encode(text), [-0.1] * len(text), [0] * len(text), "stop")


def test_the_documented_example_runs(tmp_path):
    load_example(tmp_path)
    assert "higher_lower" in ENVIRONMENTS
    task = make_task("guess_number")
    problems = task.problems("train", 20, 0)

    async def never(problem, texts):
        raise AssertionError("the environment rewards every episode")

    async def generate_group(ids, params, key):
        return [await bisect(ids, p, key) for p in params]

    services = RolloutServices(generate_group, never, decode, bisect, encode)
    for problem in problems:
        request = GroupRequest(
            "g", problem, encode(problem.prompt), 0, [SamplingParams(max_new_tokens=400, seed=1)]
        )
        (sample,) = asyncio.run(EpisodeWorkflow().run_group(request, services))
        t = sample.trajectory
        assert t.reward == 1.0 and t.reward_status == "ok", sample.text
        assert 1 <= t.episode["turns"] <= 7
        assert t.episode.get("hints", 0) == t.episode["turns"] - 1
        assert sample.text.endswith(f"<guess>{problem.answer}</guess>")

    env = ENVIRONMENTS.lookup("higher_lower")()
    env.reset(problems[0])
    result = asyncio.run(env.step(ModelTurn("<guess>maybe</guess>", [], "stop")))
    assert not result.done and result.metrics == {"malformed_calls": 1}
