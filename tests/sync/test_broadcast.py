"""The broadcast weight transport against real ``relayrl serve`` processes on loopback: one
trainer (this process, rank 0) and two built-in servers.

* a broadcast publication leaves every server holding exactly the trainer's weights (same
  checksum, the published version) and generating greedily what a server that loaded the
  same weights from disk generates;
* a server that never joins (SIGSTOP) fails the group's formation within its deadline, naming
  the server, and the next publication re-forms the group under a new name;
* a server still joining a group its trainer gave up (the stale request a resumed server
  answers first) joins the next group beside it, within the next publication's deadline;
* a server SIGKILLed mid-broadcast fails the publication within its deadline naming it; under
  the supervisor the server is restarted, loads the last disk snapshot first, and rejoins
  under a new group name, and every server ends with the newest weights;
* a server restarted between publications, when the newest one was broadcast only, loads the
  last disk snapshot and is then brought to the newest version by broadcast;
* bad requests to both new endpoints get a 4xx naming the field; the server stays up.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch

from relayrl.engine.client import RolloutClient, RolloutServerError
from relayrl.engine.engine import Engine
from relayrl.engine.transfer import tensor_specs
from relayrl.engine.types import EngineOptions, SamplingParams
from relayrl.engine.weights import weights_checksum
from relayrl.launch.servers import ServerLauncher, ServerSpec
from relayrl.launch.supervisor import ServerSupervisor
from relayrl.models.loading import load_model, load_tokenizer
from relayrl.sync.transports import BroadcastError, BroadcastPublisher, ModelSource, Snapshot
from relayrl.sync.transports.base import cpu_weights
from relayrl.sync.weight_sync import WeightSync

DEADLINE_S = 6.0  # train.broadcast_timeout_s of these tests
# what a failed publication may take past its deadline (answers, teardown): 3 s idle; the
# bound holds at load 10 on 2 cores and is still far below a hang (the client's 60 s)
SLACK_S = 20.0


def perturbed(model_dir: Path, seed: int) -> torch.nn.Module:
    """The tiny model with every parameter moved by seeded noise: weights no server has."""
    model = load_model(model_dir)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return model


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    launcher = ServerLauncher(
        ServerSpec(str(tiny_model_dir)), num_servers=2, log_dir=tmp_path_factory.mktemp("logs")
    )
    with launcher:
        yield launcher


def resume_all(launcher: ServerLauncher) -> None:
    for pid in launcher.pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


async def checksums(client: RolloutClient) -> list[tuple[str, int]]:
    return [(c["checksum"], c["weight_version"]) for c in await client.weights_checksum()]


PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


def disk_reference(model_dir: Path, snapshot_dir: Path) -> list[list[int]]:
    """Greedy outputs of an engine that loaded ``snapshot_dir`` from disk."""
    engine = Engine(load_model(model_dir), load_tokenizer(model_dir), EngineOptions())
    try:
        engine.update_weights(snapshot_dir, version=1)
        return [r.output_ids for r in engine.generate_batch(PROMPTS, GREEDY)]
    finally:
        engine.shutdown()


def test_broadcast_gives_every_server_the_trainers_weights(servers, tiny_model_dir, tmp_path):
    trainer = ModelSource(perturbed(tiny_model_dir, seed=1))
    publisher = BroadcastPublisher(DEADLINE_S, snapshot_every=1)

    async def main():
        async with RolloutClient(servers.urls) as client:
            before = await checksums(client)
            snapshot = publisher.snapshot(trainer, tmp_path, 7)
            await publisher.load(client, snapshot, "retract")
            after = await checksums(client)
            publisher.close()
            return before, after, snapshot

    before, after, snapshot = asyncio.run(main())
    expected = weights_checksum(trainer.model.named_parameters())
    assert after == [(expected, 7), (expected, 7)]
    assert all(c != expected for c, _ in before)
    assert publisher.generation == 1 and snapshot.path == tmp_path / "v7"
    reference = disk_reference(tiny_model_dir, snapshot.path)

    async def generations(url: str) -> list[list[int]]:
        async with RolloutClient(url) as client:
            return [(await client.generate(p, GREEDY)).output_ids for p in PROMPTS]

    for url in servers.urls:
        assert asyncio.run(generations(url)) == reference


class WrongGroupClient(RolloutClient):
    """Names a group the server at ``bad`` never joined when asking it to receive: the
    server answers 400 and the broadcast fails on it (a server that fails a publication
    while still answering)."""

    bad = ""

    async def update_weights_from_distributed(self, url, body):
        if url == self.bad:
            body = dict(body, group_name="relayrl-w999")
        return await super().update_weights_from_distributed(url, body)


def test_a_failed_broadcast_falls_back_to_the_disk_snapshot(servers, tiny_model_dir, tmp_path):
    """Issue 35: a broadcast that fails on a server that still answers does not end the
    publication: the held weights are written to disk and the failed server loads them."""
    trainer = ModelSource(perturbed(tiny_model_dir, seed=4))
    publisher = BroadcastPublisher(DEADLINE_S, snapshot_every=1000)

    async def main():
        async with WrongGroupClient(servers.urls, timeout=60) as client:
            first = publisher.snapshot(trainer, tmp_path, 1)  # the first: disk too
            await publisher.load(client, first, "retract")
            with torch.no_grad():
                for p in trainer.model.parameters():
                    p.mul_(1.01)
            second = publisher.snapshot(trainer, tmp_path, 2)  # broadcast only
            assert second.path is None
            client.bad = servers.urls[1]
            await publisher.load(client, second, "retract")
            publisher.close()
            return second, await checksums(client)

    second, after = asyncio.run(main())
    expected = weights_checksum(trainer.model.named_parameters())
    assert after == [(expected, 2), (expected, 2)]
    assert second.path == tmp_path / "v2" and publisher.fallbacks == 1


def test_a_server_that_never_joins_fails_formation_within_the_deadline(
    servers, tiny_model_dir, tmp_path
):
    trainer = ModelSource(perturbed(tiny_model_dir, seed=2))
    publisher = BroadcastPublisher(DEADLINE_S, snapshot_every=1)
    stopped = servers.pids[1]
    os.kill(stopped, signal.SIGSTOP)

    async def main():
        async with RolloutClient(servers.urls, timeout=60) as client:
            snapshot = publisher.snapshot(trainer, tmp_path, 3)
            start = time.monotonic()
            publication = asyncio.ensure_future(publisher.load(client, snapshot, "retract"))
            # rollouts are not wedged meanwhile: the other server generates while it waits
            async with RolloutClient(servers.urls[0]) as other:
                served = await other.generate(PROMPTS[0], GREEDY)
            generated_while_waiting = not publication.done()
            with pytest.raises(BroadcastError) as err:
                await publication
            elapsed = time.monotonic() - start
            os.kill(stopped, signal.SIGCONT)
            # the server resumes, gives up on the stale group, joins the new one
            publisher.timeout_s = 3 * DEADLINE_S
            await publisher.load(client, snapshot, "retract")
            during = (generated_while_waiting, served)
            return str(err.value), elapsed, await checksums(client), during

    try:
        message, elapsed, after, (generated_while_waiting, served) = asyncio.run(main())
    finally:
        resume_all(servers)
    assert servers.urls[1] in message and "did not join" in message, message
    assert "relayrl-w1" in message and "train.broadcast_timeout_s=6" in message, message
    assert DEADLINE_S - 0.5 <= elapsed <= DEADLINE_S + SLACK_S, elapsed
    assert generated_while_waiting and len(served.output_ids) == GREEDY.max_new_tokens
    assert publisher.generation == 2 and publisher.group.name == "relayrl-w2"
    expected = weights_checksum(trainer.model.named_parameters())
    assert after == [(expected, 3), (expected, 3)]


def test_a_join_still_waiting_for_an_abandoned_group_does_not_delay_the_next_group(
    servers, tiny_model_dir, tmp_path
):
    """What a server resumed after SIGSTOP may do first: answer the join request of the group
    its trainer gave up meanwhile. Here that stale join waits on a rendezvous that never
    answers (a port that accepts and says nothing) for 30 s; the next group still forms beside
    it, and its publication lands, within the publisher's deadline (the server used to join
    one group at a time, so the next group failed: "did not join within
    train.broadcast_timeout_s")."""
    trainer = ModelSource(perturbed(tiny_model_dir, seed=7))
    publisher = BroadcastPublisher(DEADLINE_S, snapshot_every=1)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        stale = {
            "master_address": "127.0.0.1",
            "master_port": silent.getsockname()[1],
            "rank_offset": 2,
            "world_size": 3,
            "group_name": "relayrl-w1",
            "backend": "gloo",
            "timeout_s": 30.0,
        }

        async def main():
            async with RolloutClient(servers.urls, timeout=120) as client:
                url = servers.urls[1]
                waiting = asyncio.ensure_future(client.init_weights_update_group(url, stale))
                await asyncio.sleep(1.0)  # the stale join is under way on the server
                start = time.monotonic()
                await publisher.load(client, publisher.snapshot(trainer, tmp_path, 4), "retract")
                elapsed = time.monotonic() - start
                overlapped = not waiting.done()
                waiting.cancel()
                publisher.close()
                return elapsed, overlapped, await checksums(client)

        elapsed, overlapped, after = asyncio.run(main())
    assert overlapped and elapsed <= DEADLINE_S, elapsed
    assert publisher.generation == 1 and publisher.fallbacks == 0
    expected = weights_checksum(trainer.model.named_parameters())
    assert after == [(expected, 4), (expected, 4)]


async def kill_mid_broadcast_then_recover(
    launcher: ServerLauncher,
    client: RolloutClient,
    publisher: BroadcastPublisher,
    models: tuple[torch.nn.Module, torch.nn.Module],
    tmp_path: Path,
    signal_server: Callable[[int, int], None] = os.kill,
) -> tuple[str, ServerSupervisor, list[tuple[str, list[str] | None]]]:
    """Publish ``models[0]`` (v1, disk + broadcast) under a supervisor, then ``models[1]``
    (v2, broadcast only) while server 0 is stopped and, a second later, killed (so the kill
    surely lands mid-broadcast: the group is formed and rank 0 is sending). The publication
    must fail within its deadline naming the server; then the supervisor publishes v2 again.
    Returns the killed URL, the supervisor and the disk loads ``(path, urls)`` made."""
    loads_from_disk: list[tuple[str, list[str] | None]] = []
    disk_update = client.update_weights

    async def recording_update(path, version=None, urls=None, keep_kv=False):
        loads_from_disk.append((str(path), urls))
        return await disk_update(path, version=version, urls=urls, keep_kv=keep_kv)

    client.update_weights = recording_update
    supervisor = ServerSupervisor(launcher, client, max_restarts=1)
    sync = WeightSync(supervisor, publisher, tmp_path)
    first = publisher.snapshot(ModelSource(models[0]), tmp_path, 1)
    await sync.deliver(first)
    assert publisher.group.name == "relayrl-w1"

    # 1. at the publisher: the publication fails within its deadline, naming the server
    victim_url, victim = launcher.urls[0], launcher.pids[0]
    signal_server(victim, signal.SIGSTOP)
    killer = threading.Timer(1.0, signal_server, (victim, signal.SIGKILL))
    killer.start()
    start = time.monotonic()
    second = Snapshot(2, None, cpu_weights(models[1]))  # broadcast only
    with pytest.raises(RolloutServerError) as err:
        await publisher.load(client, second, "retract")
    elapsed = time.monotonic() - start
    killer.join()
    assert err.value.url == victim_url and err.value.unreachable, err.value
    assert elapsed <= publisher.timeout_s + SLACK_S, elapsed

    # 2. under the supervisor: restart (last disk snapshot first), new group, v2
    await sync.deliver(second)
    return victim_url, supervisor, loads_from_disk


def test_a_server_killed_mid_broadcast_fails_the_publication_then_rejoins_a_new_group(
    servers, tiny_model_dir, tmp_path
):
    new = perturbed(tiny_model_dir, seed=4)
    models = (perturbed(tiny_model_dir, seed=3), new)
    publisher = BroadcastPublisher(DEADLINE_S, snapshot_every=1)

    async def main():
        async with RolloutClient(servers.urls, timeout=60) as client:
            victim_url, supervisor, loads = await kill_mid_broadcast_then_recover(
                servers, client, publisher, models, tmp_path
            )
            return victim_url, supervisor.restarts, loads, await checksums(client)

    try:
        victim_url, restarts, loads_from_disk, after = asyncio.run(main())
    finally:
        resume_all(servers)
    assert restarts == 1 and servers.urls[0] != victim_url
    # the replacement starts at v2, written to disk from the held weights at the restart
    assert loads_from_disk == [(str(tmp_path / "v2"), [servers.urls[0]])]
    assert publisher.group is not None and publisher.group.name == "relayrl-w3"
    expected = weights_checksum(new.named_parameters())
    assert after == [(expected, 2), (expected, 2)]


def test_a_server_restarted_between_publications_starts_at_a_broadcast_only_version(
    servers, tiny_model_dir, tmp_path
):
    """Disk snapshot every second publication: v1 goes to disk, v2 is broadcast only. A
    server that dies after v2 is restarted (the client's failover path) from v2, written to
    disk from the held weights then: it never serves v1 again (tokens of v1 after v2 was
    published would be staler than the bound allows, AReaL#1388). The group is dropped and
    re-formed by the next publication."""
    publisher = BroadcastPublisher(DEADLINE_S, snapshot_every=2)
    models = [perturbed(tiny_model_dir, seed=5), perturbed(tiny_model_dir, seed=6)]

    async def main():
        async with RolloutClient(servers.urls, timeout=60) as client:
            supervisor = ServerSupervisor(servers, client, max_restarts=1)
            sync = WeightSync(supervisor, publisher, tmp_path)
            paths = []
            for version, model in enumerate(models, start=1):
                snapshot = publisher.snapshot(ModelSource(model), tmp_path, version)
                await sync.deliver(snapshot)
                paths.append(snapshot.path)
            victim = servers.urls[1]
            os.kill(servers.pids[1], signal.SIGKILL)
            new_url = await supervisor.recover(victim)
            return paths, victim, new_url, sync.restart_snapshot, await checksums(client)

    paths, victim, new_url, latest, after = asyncio.run(main())
    assert paths == [tmp_path / "v1", None] and latest == (tmp_path / "v2", 2)
    assert new_url != victim and servers.urls[1] == new_url
    assert publisher.group is None and publisher.generation == 1
    expected = weights_checksum(models[1].named_parameters())
    assert after == [(expected, 2), (expected, 2)]
    publisher.close()


BAD_INIT = [
    ({"backend": "nccl"}, 400, "backend"),
    ({"rank_offset": 2, "world_size": 2}, 400, "rank_offset"),
    ({"master_port": 0}, 400, "master_port"),
    ({"group_name": None}, 400, "group_name"),
]


def bad_updates(good: dict) -> list[tuple[dict, int, str]]:
    """Changes to a good update body (every tensor of the model), each with the status and a
    piece of the error it must get."""
    n = len(good["names"])
    first = good["names"][0]
    return [
        ({"dtypes": good["dtypes"] + ["float32"]}, 400, f"dtypes: {n + 1} entries for {n} names"),
        ({"dtypes": ["float99"] + good["dtypes"][1:]}, 400, "dtypes[0]"),
        ({"names": ["no.such.weight"] + good["names"][1:]}, 400, "no.such.weight"),
        ({"names": good["names"][1:] + [first]} if n > 1 else {}, 400, "shape"),
        (
            {
                "names": good["names"][:-1],
                "dtypes": good["dtypes"][:-1],
                "shapes": good["shapes"][:-1],
            },
            400,
            "missing tensors",
        ),
        ({"names": [first] * n}, 400, "named twice"),
        ({"group_name": "relayrl-w999"}, 409, "group_name"),
        ({"names": []}, 400, "names"),
    ]


def test_bad_requests_to_the_new_endpoints_get_4xx_and_the_server_stays_up(servers, tiny_model_dir):
    url = servers.urls[0]
    model = load_model(tiny_model_dir)
    init = {
        "master_address": "127.0.0.1",
        "master_port": 29999,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "g",
        "backend": "gloo",
    }
    update = {**tensor_specs(cpu_weights(model)), "group_name": "relayrl-w1", "version": 1}
    cases = [("/init_weights_update_group", init, c) for c in BAD_INIT]
    cases += [("/update_weights_from_distributed", update, c) for c in bad_updates(update)]
    with httpx.Client(base_url=url, timeout=30) as http:
        for path, good, (change, status, needle) in cases:
            response = http.post(path, json={**good, **change})
            assert response.status_code == status, (path, change, response.text)
            assert needle in response.json()["error"], (path, change, response.text)
        assert http.post(path, content=b"{not json").status_code == 400
        assert http.get("/health").json() == {"status": "ok"}
    assert all(code is None for code in map(servers.exit_code, range(2)))
