"""The rollout controller against fake servers: the staleness bound under random delays,
admission arithmetic, replacement of rejected groups, skipped long prompts, resumable
prompt order."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass

import pytest

from relayrl.engine.types import SamplingParams
from relayrl.errors import RelayError
from relayrl.rollout.controller import (
    ControllerOptions,
    RolloutController,
    admission_capacity,
    filter_cap,
    request_seed,
)
from relayrl.rollout.eta import StalenessBound
from relayrl.rollout.prompts import PromptLoader
from relayrl.rollout.workflow import per_item, per_request
from relayrl.sync.weight_sync import publish_interval
from relayrl.tasks.base import Problem


@dataclass
class FakeGeneration:
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: str = "stop"
    resubmissions: int = 0


@dataclass
class FakeReward:
    reward: float
    status: str = "ok"


class FakeServers:
    """Generates after a random delay; tokens get the server version current when each
    half of the answer is produced (an update mid-request splits its versions)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.version = 0
        self.max_in_flight = 0
        self.in_flight = 0

    async def generate(self, ids: list[int], params: SamplingParams, key: str):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        n = self.rng.randint(2, 8)
        await asyncio.sleep(self.rng.expovariate(1 / 0.004))
        first = [self.version] * (n // 2)
        await asyncio.sleep(self.rng.expovariate(1 / 0.004))
        self.in_flight -= 1
        versions = first + [self.version] * (n - n // 2)
        return FakeGeneration([params.seed % 7] * n, [-0.5] * n, versions)


def problems(n: int = 50, long_every: int = 0) -> list[Problem]:
    out = []
    for i in range(n):
        text = "x" * (200 if long_every and i % long_every == 0 else 5)
        out.append(Problem(f"p{i}", text, "1", "math"))
    return out


def make_controller(servers, options, score, probs=None, generate=None) -> RolloutController:
    async def scorer(problem, text):
        return score(problem, text)

    return RolloutController(
        PromptLoader(probs or problems(), seed=3),
        options,
        per_request(generate or servers.generate),
        per_item(scorer),
        encode=lambda p: [1] * len(p.prompt),
        decode=lambda ids: " ".join(map(str, ids)),
    )


async def drive(
    ctrl,
    servers,
    steps: int,
    eta: int,
    rng: random.Random,
    publish_every=1,
    first_version: int = 0,
    batches: list | None = None,
):
    """A fake trainer: take batches, check staleness and the admission bound, 'train',
    publish on the training loop's own schedule (``publish_interval``). Returns the worst
    staleness trained; each batch is appended to ``batches`` when given."""
    ctrl.start()
    version, worst = first_version, 0
    interval = publish_interval(publish_every, eta)
    b = ctrl.opt.prompts_per_step
    try:
        for _ in range(steps):
            batch = await asyncio.wait_for(ctrl.next_batch(), timeout=30)
            bound = admission_capacity(ctrl.published_version, eta, b)
            assert ctrl.accepted + ctrl.running_groups <= bound
            for group in batch:
                for t in group.trajectories:
                    stale = t.staleness(version)
                    assert 0 <= stale <= eta, (stale, eta, t.versions, version)
                    worst = max(worst, stale)
            if batches is not None:
                batches.append(batch)
            await asyncio.sleep(rng.expovariate(1 / 0.01))
            version += 1
            if version - ctrl.published_version >= interval:
                servers.version = version
                ctrl.set_published_version(version)
    finally:
        await ctrl.stop()
    return worst


def one_batch(ctrl: RolloutController):
    """Start the controller, take one batch, stop it."""

    async def run():
        ctrl.start()
        try:
            return await ctrl.next_batch()
        finally:
            await ctrl.stop()

    return asyncio.run(run())


@pytest.mark.parametrize("trial", range(12))
def test_staleness_bound_under_random_delays(trial):
    rng = random.Random(trial)
    eta = rng.choice([0, 1, 2, 4])
    options = ControllerOptions(
        n_samples=(n := rng.randint(1, 4)),
        prompts_per_step=rng.randint(1, 4),
        staleness=StalenessBound(eta),
        max_new_tokens=8,
        dynamic_sampling=n >= 2 and rng.random() < 0.5,
        concurrency=rng.choice([0, 0, 6]),
    )
    servers = FakeServers(rng)
    ctrl = make_controller(servers, options, lambda p, t: FakeReward(float(rng.random() < 0.5)))
    worst = asyncio.run(drive(ctrl, servers, 15, eta, rng, publish_every=rng.randint(1, 3)))
    assert worst <= eta
    if options.concurrency:
        assert servers.max_in_flight <= options.concurrency


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_rare_publication_is_capped_so_admission_never_starves(eta):
    """``train.publish_every`` larger than η + 1 would leave the admission bound
    (p + η + 1)·B behind the trainer and deadlock the run; the loop publishes at least every
    η + 1 steps, and 12 steps finish."""
    assert publish_interval(100, eta) == eta + 1
    rng = random.Random(eta)
    options = small(eta=eta)
    servers = FakeServers(rng)
    ctrl = make_controller(servers, options, lambda p, t: FakeReward(1.0))
    assert asyncio.run(drive(ctrl, servers, 12, eta, rng, publish_every=100)) <= eta
    assert ctrl.published_version >= 12 - (eta + 1)


def small(eta: int, **kw) -> ControllerOptions:
    """Options of the small runs below: a fixed bound ``eta``, groups of 2 samples, 2
    prompts a step, 8 new tokens, no dynamic-sampling filter; ``kw`` overrides."""
    return ControllerOptions(
        **{
            "staleness": StalenessBound(eta),
            "n_samples": 2,
            "prompts_per_step": 2,
            "max_new_tokens": 8,
            "dynamic_sampling": False,
            **kw,
        }
    )


def test_failing_generation_stops_the_run_after_the_limit(capsys):
    """An unexpected exception (here a ValueError, as a programming error would be) drops its
    group, is counted, and its traceback is printed once, not once per group (issue 46: it
    was silent until the run failed)."""

    async def broken(ids, params, key):
        raise ValueError("bad request")

    options = small(eta=1, max_consecutive_errors=5)
    ctrl = make_controller(None, options, lambda p, t: FakeReward(1.0), generate=broken)
    with pytest.raises(RelayError, match="5 groups failed in a row: bad request"):
        one_batch(ctrl)
    assert ctrl.counters["rejected_error"] >= 5
    assert ctrl.counters["unexpected_errors"] >= 5
    err = capsys.readouterr().err
    assert err.count("warning: group") == 1 and err.count("Traceback") == 1
    assert "ValueError: bad request" in err and "in broken" in err


def filtering(prompts_per_step: int = 2, eta: int = 1, **kw) -> ControllerOptions:
    """Options with dynamic sampling on, groups of two samples."""
    return small(eta=eta, prompts_per_step=prompts_per_step, dynamic_sampling=True, **kw)


def test_dynamic_sampling_that_drops_everything_stops_the_run():
    servers = FakeServers(random.Random(3))
    options = filtering(max_consecutive_filtered=7)
    ctrl = make_controller(servers, options, lambda p, t: FakeReward(1.0))
    with pytest.raises(RelayError, match="dynamic sampling saw 7 groups in a row"):
        one_batch(ctrl)


def test_filter_cap_fills_the_batch_with_all_equal_groups():
    """Past ``max_filtered_per_step`` dropped groups in a step, an all-equal group is kept:
    the batch is handed out with such groups (zero GRPO advantages) instead of waiting."""
    assert filter_cap(4.0, 16) == 64 and filter_cap(0.1, 3) == 1 and filter_cap(None, 8) is None
    servers = FakeServers(random.Random(4))
    options = filtering(prompts_per_step=3, eta=0, max_filtered_per_step=2)
    ctrl = make_controller(servers, options, lambda p, t: FakeReward(1.0))
    batch = one_batch(ctrl)
    assert ctrl.counters["rejected_filtered"] == 2
    assert ctrl.counters["accepted_uniform_groups"] == 3
    assert [t.advantage for g in batch for t in g.trajectories] == [0.0] * 6


def test_filter_cap_resets_every_step_and_is_checkpointed():
    """The cap counts the groups dropped since the last batch was handed out: each of two
    consecutive batches drops exactly ``max_filtered_per_step`` (issue 35: only one batch was
    tested); a checkpoint taken mid-step carries the count, so a resumed controller drops
    only what the step has left (here 1 of 2), and a fresh step starts from 0 again."""
    options = filtering(prompts_per_step=3, eta=0, max_filtered_per_step=2)

    async def two_batches(ctrl):
        ctrl.start()
        try:
            await ctrl.next_batch()
            dropped_first = ctrl.counters["rejected_filtered"]
            after_first = ctrl.state_dict()["filtered_this_step"]
            ctrl.set_published_version(1)  # η = 0: the next batch waits for v1
            await ctrl.next_batch()
            return dropped_first, after_first, ctrl.counters["rejected_filtered"]
        finally:
            await ctrl.stop()

    ctrl = make_controller(FakeServers(random.Random(6)), options, lambda p, t: FakeReward(1.0))
    assert asyncio.run(two_batches(ctrl)) == (2, 0, 4)

    source = make_controller(FakeServers(random.Random(7)), options, lambda p, t: FakeReward(1.0))
    state = json.loads(json.dumps(source.state_dict()))  # as a checkpoint stores it
    state["filtered_this_step"] = 1  # one group of this step was dropped before the save
    resumed = make_controller(FakeServers(random.Random(7)), options, lambda p, t: FakeReward(1.0))
    resumed.load_state_dict(state)
    assert resumed.state_dict()["filtered_this_step"] == 1
    one_batch(resumed)
    assert resumed.counters["rejected_filtered"] == 1  # the step's cap had 1 left
    assert resumed.counters["accepted_uniform_groups"] == 3
    assert resumed.state_dict()["filtered_this_step"] == 0


def test_filter_cap_still_stops_a_run_whose_groups_are_all_equal():
    """Kept past the cap or dropped, all-equal groups in a row count toward
    ``max_consecutive_filtered``: a task the model cannot move still stops the run."""
    rng = random.Random(5)
    servers = FakeServers(rng)
    options = filtering(max_filtered_per_step=1, max_consecutive_filtered=9)
    ctrl = make_controller(servers, options, lambda p, t: FakeReward(0.0))
    with pytest.raises(RelayError, match="dynamic sampling saw 9 groups in a row"):
        asyncio.run(drive(ctrl, servers, 20, 1, rng))
    assert ctrl.counters["accepted_uniform_groups"] >= 1


def test_async_actually_overlaps_and_reaches_eta():
    rng = random.Random(0)
    options = small(eta=2)
    servers = FakeServers(rng)
    ctrl = make_controller(servers, options, lambda p, t: FakeReward(1.0))
    assert asyncio.run(drive(ctrl, servers, 20, 2, rng)) >= 1  # stale samples do get trained


def test_rejected_groups_are_replaced_and_not_counted():
    rng = random.Random(1)
    options = small(eta=0, prompts_per_step=3, dynamic_sampling=True)
    servers = FakeServers(rng)

    # prompts with an even number are 'all equal' (filtered), odd ones mixed
    def score(problem, text):
        if int(problem.id[1:]) % 2 == 0:
            return FakeReward(1.0)
        return FakeReward(float(text.startswith(("0", "2", "4", "6"))))

    ctrl = make_controller(servers, options, score)

    batch = one_batch(ctrl)
    assert len(batch) == 3
    assert ctrl.counters["rejected_filtered"] >= 1
    assert (
        ctrl.accepted == 3
        and ctrl.counters["admitted_groups"]
        >= 3 + ctrl.counters["rejected_filtered"] - ctrl.running_groups
    )
    for group in batch:
        rewards = {t.reward for t in group.trajectories}
        assert len(rewards) == 2
        assert abs(sum(t.advantage for t in group.trajectories)) < 1e-6


def test_long_prompts_are_skipped_and_counted():
    rng = random.Random(2)
    options = small(eta=0, n_samples=1, prompts_per_step=8, max_context=64)
    servers = FakeServers(rng)
    ctrl = make_controller(servers, options, lambda p, t: FakeReward(1.0), problems(40, 2))

    batch = one_batch(ctrl)
    assert all(len(g.prompt_ids) + 8 <= 64 for g in batch)
    assert ctrl.counters["skipped_long_prompts"] >= 1


def test_generation_error_rejects_the_group_only():
    rng = random.Random(3)
    servers = FakeServers(rng)
    calls = {"n": 0}

    async def flaky(ids, params, key):
        calls["n"] += 1
        if calls["n"] == 2:
            raise ValueError("bad request")
        return await servers.generate(ids, params, key)

    options = small(eta=0)
    ctrl = make_controller(servers, options, lambda p, t: FakeReward(1.0), generate=flaky)
    assert len(one_batch(ctrl)) == 2
    assert ctrl.counters["rejected_error"] == 1


def test_admission_capacity_and_seeds():
    assert admission_capacity(0, 0, 8) == 8
    assert admission_capacity(3, 4, 8) == 64
    seeds = {request_seed(0, i, j) for i in range(50) for j in range(8)}
    assert len(seeds) == 400
    assert request_seed(1, 0, 0) != request_seed(0, 0, 0)


def test_prompt_loader_is_seeded_and_resumable():
    a = PromptLoader(problems(7), seed=5)
    first = [a.next()[1].id for _ in range(10)]
    b = PromptLoader(problems(7), seed=5)
    assert [b.next()[1].id for _ in range(10)] == first
    state = a.state_dict()
    c = PromptLoader(problems(7), seed=5)
    c.load_state_dict(state)
    assert [c.next() for _ in range(9)] == [a.next() for _ in range(9)]
    assert sorted(first[:7]) == sorted(p.id for p in problems(7))  # each epoch is a permutation


def test_sample_still_aborted_rejects_its_group_and_is_never_trained():
    """The client gives up resubmitting after ``max_resubmits`` and returns the partial
    output with finish_reason 'abort': the group is rejected, counted and replaced."""
    servers = FakeServers(random.Random(4))

    async def gives_up_once(ids, params, key):
        out = await servers.generate(ids, params, key)
        if key == "g0" and params.seed == request_seed(0, 0, 1):
            out.finish_reason, out.resubmissions = "abort", 32
        return out

    options = small(eta=0)
    ctrl = make_controller(servers, options, lambda p, t: FakeReward(1.0), generate=gives_up_once)
    batch = one_batch(ctrl)
    assert [g.key for g in batch] == ["g1", "g2"]
    assert all(t.finish_reason != "abort" for g in batch for t in g.trajectories)
    assert ctrl.counters["rejected_aborted"] == 1
    assert ctrl.accepted == 2


def test_an_error_while_admitting_stops_the_run_instead_of_hanging():
    """A prompt the run cannot encode (a chat template that refuses model.system_prompt,
    say) fails admission: the batch wait raises it (issue 44 item 2: the admission task
    died and `relayrl train` waited forever, silently)."""

    def refuse(problem):
        raise RelayError("model.system_prompt: the tokenizer's chat template refuses it")

    options = small(eta=1)
    ctrl = make_controller(FakeServers(random.Random(0)), options, lambda p, t: FakeReward(1.0))
    ctrl._encode = refuse

    async def run():
        ctrl.start()
        try:
            return await asyncio.wait_for(ctrl.next_batch(), timeout=10)
        finally:
            await ctrl.stop()

    with pytest.raises(RelayError, match="model.system_prompt"):
        asyncio.run(run())
