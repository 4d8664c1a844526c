"""A two-turn episode on a real loopback rollout server, with a weight update (pause →
load → continue) in the middle of its second model turn: every token keeps its origin, the
version that produced it and the behaviour logprob of that version's policy; the
environment's tokens are version-tagged like the model token before them and untrained;
the episode's staleness is its oldest model token's."""

from __future__ import annotations

import asyncio
import copy

from relayrl.engine.client import RolloutClient
from relayrl.engine.types import SamplingParams
from relayrl.rollout.environment import (
    Environment,
    ModelTurn,
    StepResult,
    register_environment,
    turn_seed,
)
from relayrl.rollout.trajectory import ORIGIN_ENV, ORIGIN_MODEL
from relayrl.rollout.workflow import EpisodeWorkflow, GroupRequest, RolloutServices
from relayrl.tasks.base import Problem
from tests.engine.conftest import perturbed_state, recompute_logprobs
from tests.engine.test_server import served  # noqa: F401 - the loopback server fixture

TURN_TOKENS = 40
OBSERVATION = " = 42\n"


@register_environment
class TwoTurns(Environment):
    """Turn 0 gets an observation, turn 1 ends the episode with reward 1."""

    name = "test_two_turns"
    max_turns = 2
    max_turn_tokens = TURN_TOKENS

    def reset(self, problem: Problem) -> str:
        self.turns = 0
        return ""

    async def step(self, turn: ModelTurn) -> StepResult:
        self.turns += 1
        if self.turns == 1:
            return StepResult(observation=OBSERVATION, metrics={"tool_calls": 1})
        return StepResult(done=True, reward=1.0)


def test_weight_update_inside_a_turn_keeps_versions_and_logprobs(
    served,  # noqa: F811
    tiny_model,
    tiny_tokenizer,
    tmp_path,
):
    old_model = copy.deepcopy(tiny_model)
    new_model = copy.deepcopy(tiny_model)
    new_model.load_state_dict(perturbed_state(tiny_model), strict=False)
    new_model.save_pretrained(tmp_path / "v5")
    engine, url = served()
    prompt = [7, 8, 9, 10]
    obs_ids = tiny_tokenizer(OBSERVATION, add_special_tokens=False)["input_ids"]
    problem = Problem("p0", "x", "1", "math", {"environment": TwoTurns.name})
    params = SamplingParams(max_new_tokens=200, temperature=1.0, seed=11, ignore_eos=True)
    request = GroupRequest("g0", problem, prompt, submit_version=0, sampling=[params])

    async def scenario():
        async with RolloutClient(url) as client:

            async def never_graded(problem, texts):
                raise AssertionError("the environment gave the reward")

            services = RolloutServices(
                generate_group=lambda ids, ps, key: client.generate_many(
                    [ids] * len(ps), ps, key=key
                ),
                score_group=never_graded,
                decode=lambda ids: tiny_tokenizer.decode(ids),
                generate=lambda ids, p, key: client.generate(ids, p, key=key),
                encode_text=lambda text: tiny_tokenizer(text, add_special_tokens=False)[
                    "input_ids"
                ],
            )
            task = asyncio.create_task(EpisodeWorkflow().run_group(request, services))
            # 10 tokens into the second model turn
            while engine.stats()["generated_tokens"] < TURN_TOKENS + 10:
                await asyncio.sleep(0.005)
            await client.pause("abort")
            await client.update_weights(str(tmp_path / "v5"), version=5)
            await client.continue_generation()
            return await task

    (sample,) = asyncio.run(scenario())
    t = sample.trajectory
    n_obs = len(obs_ids)
    assert t.completion_ids[TURN_TOKENS : TURN_TOKENS + n_obs] == obs_ids
    assert (
        t.origins
        == [ORIGIN_MODEL] * TURN_TOKENS + [ORIGIN_ENV] * n_obs + [ORIGIN_MODEL] * TURN_TOKENS
    )
    assert t.model_mask == [o == ORIGIN_MODEL for o in t.origins]
    assert t.reward == 1.0 and t.reward_status == "ok"
    assert t.episode == {"turns": 2.0, "tool_calls": 1.0, "env_tokens": float(n_obs)}
    assert sample.resubmissions >= 1

    second = slice(TURN_TOKENS + n_obs, None)
    turn1_versions = t.versions[second]
    n_old = turn1_versions.count(0)
    assert 10 <= n_old < TURN_TOKENS
    assert turn1_versions == [0] * n_old + [5] * (TURN_TOKENS - n_old)
    assert t.versions[: TURN_TOKENS + n_obs] == [0] * (TURN_TOKENS + n_obs)
    assert t.behav_logprobs[TURN_TOKENS : TURN_TOKENS + n_obs] == [0.0] * n_obs
    assert t.oldest_version == 0 and t.newest_version == 5 and t.staleness(5) == 5

    # behaviour logprobs: each model token under the weights of its version, over the
    # whole context (prompt, earlier turns, the observation)
    old_ref = recompute_logprobs(old_model, prompt, t.completion_ids, 1.0)
    new_ref = recompute_logprobs(new_model, prompt, t.completion_ids, 1.0)
    for i, (origin, version) in enumerate(zip(t.origins, t.versions, strict=True)):
        if origin == ORIGIN_MODEL:
            ref = old_ref[i] if version == 0 else new_ref[i]
            assert abs(ref - t.behav_logprobs[i]) < 1e-4, (i, version)
    # turn 1 was sampled with its own seed, not turn 0's
    assert turn_seed(11, 1) not in (None, 11)
    assert engine.stats()["num_requests"] == 0
