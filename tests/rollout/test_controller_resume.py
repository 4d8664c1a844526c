"""Controller state across a checkpoint: complete-but-untrained groups keep their
trajectories and versions, in-flight prompts are generated again first, and the resumed run
trains exactly the prompts, in the order, that an uninterrupted run trains."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from relayrl.errors import RelayError
from relayrl.rollout.controller import ControllerOptions
from relayrl.rollout.eta import StalenessBound
from relayrl.rollout.prompts import PromptLoader
from tests.rollout.test_controller import FakeReward, FakeServers, make_controller, problems

OPTIONS = dict(n_samples=2, prompts_per_step=3, max_new_tokens=8)


async def train(ctrl, servers, steps, eta, version, rng, stop_at=None):
    """A fake trainer from ``version``: returns the trained (group index, prompt index)
    pairs and, when stopping at ``stop_at`` steps, the JSON state at that boundary."""
    ctrl.start()
    trained, state = [], None
    try:
        for _ in range(steps):
            batch = await ctrl.next_batch()
            for group in batch:
                assert all(t.staleness(version) <= eta for t in group.trajectories)
                trained.append((group.index, group.prompt_index))
            await asyncio.sleep(rng.expovariate(1 / 0.01))
            version += 1
            servers.version = version
            ctrl.set_published_version(version)
            if version == stop_at:
                state = json.loads(json.dumps(ctrl.state_dict()))  # what a checkpoint keeps
                break
    finally:
        await ctrl.stop()
    return trained, state


@pytest.mark.parametrize("seed", range(4))
def test_resumed_controller_trains_the_same_prompts_in_the_same_order(seed):
    rng = random.Random(seed)
    eta, steps, stop_at = 2, 10, rng.randint(2, 7)
    options = ControllerOptions(staleness=StalenessBound(eta), **OPTIONS, dynamic_sampling=False)

    def run(ctrl, servers, *args, **kw):
        return asyncio.run(train(ctrl, servers, *args, **kw))

    servers = FakeServers(random.Random(seed))
    full, _ = run(
        make_controller(servers, options, lambda p, t: FakeReward(1.0)), servers, steps, eta, 0, rng
    )

    servers = FakeServers(random.Random(seed + 100))  # other timings: other in-flight sets
    first, state = run(
        make_controller(servers, options, lambda p, t: FakeReward(1.0)),
        servers,
        steps,
        eta,
        0,
        rng,
        stop_at,
    )
    ready = [g for g in state["pending"] if g["status"] == "ready"]
    assert all(len(g["trajectories"]) == 2 for g in ready)

    servers = FakeServers(random.Random(seed + 200))
    servers.version = stop_at
    resumed = make_controller(servers, options, lambda p, t: FakeReward(1.0))
    resumed.load_state_dict(state)
    resumed.set_published_version(stop_at)
    assert resumed.restored_counts() == (
        len(ready),
        len(state["pending"]) - len(ready),
    )
    rest, _ = run(resumed, servers, steps - stop_at, eta, stop_at, rng)
    assert first + rest == full  # no prompt skipped or repeated, same order
    restored = {g["index"]: g for g in ready}
    assert len({i for i, _ in rest} & set(restored)) == len(restored)  # all of them trained


def state_at(eta: int, stop_at: int, seed: int) -> dict:
    """The controller state after ``stop_at`` steps of a run with bound ``eta``."""
    rng = random.Random(seed)
    servers = FakeServers(rng)
    ctrl = make_controller(
        servers,
        ControllerOptions(staleness=StalenessBound(eta), **OPTIONS, dynamic_sampling=False),
        lambda p, t: FakeReward(1.0),
    )
    return asyncio.run(train(ctrl, servers, 9, eta, 0, rng, stop_at))[1]


def test_restored_group_beyond_eta_is_refused():
    state = state_at(eta=2, stop_at=3, seed=0)
    ready = [g for g in state["pending"] if g["status"] == "ready"]
    assert any(min(t["versions"]) < 3 for g in ready for t in g["trajectories"])
    strict = make_controller(
        FakeServers(random.Random(0)),
        ControllerOptions(staleness=StalenessBound(0), **OPTIONS, dynamic_sampling=False),
        None,
    )
    with pytest.raises(RelayError, match="above rollout.eta=0: it must not be trained"):
        strict.load_state_dict(state)


def test_changed_prompts_are_refused():
    state = state_at(eta=1, stop_at=2, seed=1)
    options = ControllerOptions(staleness=StalenessBound(1), **OPTIONS, dynamic_sampling=False)
    other = make_controller(FakeServers(random.Random(1)), options, None, probs=problems(50)[::-1])
    with pytest.raises(RelayError, match="train prompts changed since the checkpoint"):
        other.load_state_dict(state)


def test_problem_at_matches_the_draws():
    loader = PromptLoader(problems(7), seed=5)
    drawn = [loader.next() for _ in range(20)]
    fresh = PromptLoader(problems(7), seed=5)
    assert [fresh.problem_at(i).id for i, _ in drawn] == [p.id for _, p in drawn]
