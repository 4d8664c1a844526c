"""The broadcast weight transport with a REAL vLLM server (``train.weight_transport=broadcast``,
``rollout.engine=vllm``): this process is the trainer (rank 0 of a gloo group), the server's
worker joins through relayrl's worker extension. One server for the module on loopback.

* a broadcast publication is served exactly as the same snapshot loaded from disk: the same
  tokens, logprobs and per-token versions over the wire, and logprobs equal to the trainer's
  recompute of the published weights; a second publication reuses the group;
* a server that never joins (stopped) fails the group's formation within
  ``train.broadcast_timeout_s``, naming the server; the next publication re-forms the group
  under a new name and is served;
* a server SIGKILLed while the trainer broadcasts fails the publication within its deadline,
  naming the server; under the supervisor it is restarted, loads the last disk snapshot
  first, rejoins under a new group name and serves the newest weights (last: it replaces the
  module's server).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from relayrl.engine.types import SamplingParams
from relayrl.engine.vllm_client import VLLMClient
from relayrl.launch.publish import (
    BroadcastError,
    BroadcastPublisher,
    ModelSource,
)
from relayrl.models.loading import load_model
from tests.launch._vllm import MAX_LOGPROB_DIFF, needs_vllm, perturbed, prompts, recompute
from tests.launch._vllm import vllm_servers as start_vllm
from tests.launch.test_broadcast import kill_mid_broadcast_then_recover

pytestmark = needs_vllm

DEADLINE_S = 8.0  # train.broadcast_timeout_s of these tests
SLACK_S = 4.0  # what a failed publication may take past its deadline (answers, teardown)
BATCH = prompts(4, seed=3)
SAMPLED = [SamplingParams(max_new_tokens=16, seed=i, ignore_eos=True) for i in range(4)]
GREEDY = [SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)] * 4


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with start_vllm(tiny_model_dir, tmp_path_factory.mktemp("vllm-logs")) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return load_model(tiny_model_dir, "cpu", "float32").eval()


async def served(client: VLLMClient) -> list[tuple[list[int], list[float], list[int]]]:
    """(tokens, logprobs, versions) of the seeded-sampled and greedy requests."""
    requests = [*zip(BATCH, SAMPLED, strict=True), *zip(BATCH, GREEDY, strict=True)]
    gens = await asyncio.gather(*(client.generate(p, q) for p, q in requests))
    return [(g.output_ids, g.output_logprobs, g.output_versions) for g in gens]


def assert_serves(outputs, model: torch.nn.Module, version: int) -> None:
    """Every sampled token carries ``version`` and the logprob ``model`` gives it."""
    for prompt, (ids, logprobs, versions) in zip(BATCH, outputs[:4], strict=True):
        assert versions == [version] * len(ids)
        ref = recompute(model, prompt, ids, 1.0)
        assert (torch.tensor(logprobs) - ref).abs().max().item() < MAX_LOGPROB_DIFF


def signal_group(pid: int, sig: signal.Signals) -> None:
    """A vLLM server leads a process group (API server, engine core, worker): all of it."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def test_a_broadcast_publication_is_served_as_the_same_snapshot_from_disk(server, policy, tmp_path):
    url = server.urls[0]
    publisher = BroadcastPublisher(DEADLINE_S, snapshot_every=1)
    new, newer = perturbed(policy, seed=11), perturbed(policy, seed=12)

    async def main():
        async with VLLMClient([url], timeout=120) as client:
            first = publisher.snapshot(ModelSource(new), tmp_path, 5)
            start = time.perf_counter()
            await publisher.load(client, first, "retract")
            seconds = time.perf_counter() - start
            by_broadcast = await served(client)
            await client.update_weights(str(first.path), version=5)
            from_disk = await served(client)
            # a second publication through the same group ("abort": paused by the publisher)
            second = publisher.snapshot(ModelSource(newer), tmp_path, 6)
            await publisher.load(client, second, "abort")
            after_second = await served(client)
            # back to the base weights for the other tests
            base = publisher.snapshot(ModelSource(policy), tmp_path, 0)
            await publisher.load(client, base, "retract")
            publisher.close()
            return seconds, by_broadcast, from_disk, after_second

    seconds, by_broadcast, from_disk, after_second = asyncio.run(main())
    print(
        f"broadcast publication (group formed, pause, receive, load, version, resume): {seconds:.3f}s"
    )
    assert by_broadcast == from_disk  # tokens, logprobs and versions, exactly
    assert_serves(by_broadcast, new, 5)
    assert_serves(after_second, newer, 6)
    old = recompute(policy, BATCH[0], by_broadcast[0][0], 1.0)
    assert (torch.tensor(by_broadcast[0][1]) - old).abs().max().item() > 10 * MAX_LOGPROB_DIFF
    assert publisher.generation == 1  # one group for the three publications


def test_a_server_that_never_joins_fails_within_the_deadline(server, policy, tmp_path):
    url, pid = server.urls[0], server.pids[0]
    publisher = BroadcastPublisher(DEADLINE_S, snapshot_every=1)
    new = perturbed(policy, seed=13)
    signal_group(pid, signal.SIGSTOP)

    async def main():
        async with VLLMClient([url], timeout=120) as client:
            snapshot = publisher.snapshot(ModelSource(new), tmp_path, 3)
            start = time.monotonic()
            with pytest.raises(BroadcastError) as err:
                await publisher.load(client, snapshot, "retract")
            elapsed = time.monotonic() - start
            signal_group(pid, signal.SIGCONT)
            # the server resumes, gives up on the stale group, joins a new one
            publisher.timeout_s = 3 * DEADLINE_S
            await publisher.load(client, snapshot, "retract")
            outputs = await served(client)
            await publisher.load(
                client, publisher.snapshot(ModelSource(policy), tmp_path, 0), "retract"
            )
            publisher.close()
            return str(err.value), elapsed, outputs

    try:
        message, elapsed, outputs = asyncio.run(main())
    finally:
        signal_group(pid, signal.SIGCONT)
    assert url in message and "did not join" in message, message
    assert "relayrl-w1" in message and "train.broadcast_timeout_s=8" in message, message
    assert DEADLINE_S - 0.5 <= elapsed <= DEADLINE_S + SLACK_S, elapsed
    assert publisher.generation == 2
    assert_serves(outputs, new, 3)


def test_a_server_killed_mid_broadcast_fails_the_publication_then_rejoins_from_disk(
    server, policy, tmp_path
):
    """Last: the module's server is replaced (the steps: ``kill_mid_broadcast_then_recover``,
    shared with the built-in engine's test)."""
    new = perturbed(policy, seed=15)
    publisher = BroadcastPublisher(DEADLINE_S, snapshot_every=1)

    async def main():
        async with VLLMClient(server.urls, timeout=120) as client:
            victim_url, supervisor, loads = await kill_mid_broadcast_then_recover(
                server, client, publisher, (perturbed(policy, seed=14), new), tmp_path, signal_group
            )
            outputs = await served(client)
            publisher.close()
            return victim_url, supervisor.restarts, loads, outputs

    victim_url, restarts, loads_from_disk, outputs = asyncio.run(main())
    assert restarts == 1 and server.urls[0] != victim_url
    assert loads_from_disk == [(str(tmp_path / "v1"), [server.urls[0]])]
    assert publisher.generation == 3  # w1, w2 (formation with the dead server fails), w3
    assert_serves(outputs, new, 2)


def test_the_wire_module_is_what_the_vllm_server_loads():
    """The extension and relayrl share one wire module (no copy): the server's PYTHONPATH
    names its directory, and it imports nothing from relayrl."""
    from relayrl.engine.wire import relayrl_transfer_wire
    from relayrl.launch.vllm import WIRE_DIR, VLLMServerSpec

    path = VLLMServerSpec("m", "python").environment(0)["PYTHONPATH"].split(os.pathsep)
    assert str(WIRE_DIR) in path and Path(relayrl_transfer_wire.__file__).parent == WIRE_DIR
    source = Path(relayrl_transfer_wire.__file__).read_text()
    assert "import relayrl" not in source and "from relayrl" not in source
