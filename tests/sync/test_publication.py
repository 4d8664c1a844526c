"""Publication as a transaction (relayrl.sync.transaction), one test per exit path, on the
supervisor's fakes (tests/launch/test_supervisor.py: a hung fake server answers nothing until
it is killed, a dead one is unreachable): success; a server that answers an error; a step
past its deadline; the whole publication past its deadline; a cancellation (the run ending);
a server restarted mid-way; a server the failed publication cannot resume (killed and
restarted); the watchdog resuming a server kept paused; a server reporting stale weights
under the new label. Every path leaves every server resumed or restarted, and every
failure is one error naming the server, the step and the version."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from relayrl.config.schema import TrainConfig
from relayrl.engine.client import Generation, RolloutClient, RolloutServerError, WeightsReport
from relayrl.engine.engine import Engine
from relayrl.engine.weights import weights_checksum
from relayrl.launch.servers import ServerLauncher, ServerSpec
from relayrl.launch.supervisor import ServerSupervisor
from relayrl.models.loading import load_model
from relayrl.rollout.controller import ControllerOptions, RolloutController
from relayrl.rollout.eta import StalenessBound
from relayrl.rollout.prompts import PromptLoader
from relayrl.sync.canary import Canary, reference_logprobs
from relayrl.sync.clock import VersionClock
from relayrl.sync.transaction import Deadlines, PublicationError
from relayrl.sync.transports import DiskPublisher, ModelSource, Snapshot, make_publisher
from relayrl.sync.weight_sync import WeightSync
from relayrl.tasks.base import Problem
from tests.launch.test_supervisor import FakeClient, FakeLauncher, health_from_fake_urls


@pytest.fixture(autouse=True)
def health_from_fake(monkeypatch):
    health_from_fake_urls(monkeypatch)


class FaultyClient(FakeClient):
    """``errors``: URL -> the error its load answers; ``stale``: URLs that keep their old
    weights but take the new label (their checksum is not the published one)."""

    def __init__(self, launcher: FakeLauncher) -> None:
        super().__init__(launcher)
        self.errors: dict[str, str] = {}
        self.stale: set[str] = set()
        self.resumed: list[str] = []

    async def update_weights(self, model_path, version=None, urls=None, keep_kv=False):
        for url in urls or list(self.launcher.urls):
            if url in self.errors:
                raise RolloutServerError(url, self.errors[url], 500)
        return await super().update_weights(model_path, version, urls, keep_kv)

    async def continue_generation(self, urls=None):
        await super().continue_generation(urls)
        self.resumed += urls or list(self.launcher.urls)

    async def weights_report(self, url: str) -> WeightsReport:
        report = await super().weights_report(url)
        return WeightsReport(report.version, "0" * 64 if url in self.stale else "c" * 64)


def make(mode: str = "abort", step_s: float = 5.0, total_s: float = 10.0):
    launcher = FakeLauncher(2)
    client = FaultyClient(launcher)
    supervisor = ServerSupervisor(launcher, client, 3)
    sync = WeightSync(
        supervisor, DiskPublisher(), Path("/w"), mode=mode, deadlines=Deadlines(step_s, total_s)
    )
    return launcher, client, supervisor, sync


def publish(sync: WeightSync, version: int = 5, checksum: str = "c" * 64):
    return sync.deliver(Snapshot(version, f"/w/v{version}", checksum=checksum))


def test_success_pauses_loads_verifies_and_resumes_every_server():
    launcher, client, s, sync = make()
    asyncio.run(publish(sync))
    assert client.calls == ["pause:abort"] * 2 + ["load:5"] * 2 + ["continue"] * 2
    assert sorted(client.resumed) == launcher.urls and not sync.transaction.watch.paused


def test_an_error_answer_fails_naming_server_step_and_version_and_resumes_all():
    launcher, client, s, sync = make()
    client.errors["http://s1"] = "HTTP 500: out of memory"
    with pytest.raises(PublicationError) as err:
        asyncio.run(publish(sync))
    message = str(err.value)
    assert message.startswith("publication of weights v5: rollout server(s) http://s1: load")
    assert "out of memory" in message and err.value.step == "load"
    assert sorted(client.resumed) == launcher.urls and not sync.transaction.watch.paused
    assert s.restarts == 0


def test_a_step_past_its_deadline_fails_and_a_server_that_cannot_resume_is_restarted():
    """s1 hangs (answers nothing, /health included, but the watchdog is not running): the
    load step ends at its deadline naming s1; its resume cannot be sent either, so s1 is
    killed and restarted; s0 is resumed."""
    launcher, client, s, sync = make(step_s=0.3)

    async def main():
        await publish(sync, 1)
        launcher.hung.add("http://s1")
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(PublicationError) as err:
            await publish(sync, 2)
        return err.value, loop.time() - start

    error, elapsed = asyncio.run(asyncio.wait_for(main(), 10))
    assert error.step == "pause" and error.servers == ["http://s1"], error
    assert "no answer within train.publish_step_timeout_s=0.3" in str(error)
    assert elapsed < 0.3 * 2 + 2.0, elapsed  # the step, then the resume, each bounded
    assert launcher.killed == ["http://s1"] and s.restarts == 1
    assert launcher.urls == ["http://s0", "http://s1-r1"] and not sync.transaction.watch.paused
    assert "http://s0" in client.resumed[-2:]
    # the replacement loads the restart source: the newest disk snapshot (the run then ends
    # on the error; a later publication would bring every server to one version)
    assert client.loaded[-1] == ("http://s1-r1", "/w/v2", 2)


def test_the_whole_publication_past_its_deadline_fails_naming_the_step():
    launcher, client, s, sync = make(mode="retract", step_s=5.0, total_s=0.4)
    launcher.hung.add("http://s0")

    async def main():
        with pytest.raises(PublicationError) as err:
            await publish(sync)
        launcher.hung.discard("http://s0")
        return err.value

    error = asyncio.run(asyncio.wait_for(main(), 10))
    assert error.step == "load" and error.servers == ["http://s0"]
    assert "train.publish_timeout_s=0.4 (the whole publication)" in str(error)


def test_a_cancelled_publication_resumes_what_it_paused():
    """The run ending cancels the publication in flight: it still resumes the servers."""
    launcher, client, s, sync = make(step_s=2.0)
    launcher.hung.add("http://s1")

    async def main():
        task = asyncio.ensure_future(publish(sync))
        while "pause:abort" not in client.calls:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        launcher.hung.discard("http://s1")  # it answers again, but the run is ending
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(main(), 10))
    assert sorted(client.resumed) == launcher.urls and not sync.transaction.watch.paused
    assert not any(c.startswith("load") for c in client.calls)


def test_a_server_restarted_mid_publication_gets_the_publication_repeated():
    launcher, client, s, sync = make()
    launcher.dead.add("http://s1")
    asyncio.run(asyncio.wait_for(publish(sync, 3), 10))
    assert s.restarts == 1 and launcher.urls == ["http://s0", "http://s1-r1"]
    assert ("http://s0", "/w/v3", 3) in client.loaded
    assert ("http://s1-r1", "/w/v3", 3) in client.loaded
    assert not sync.transaction.watch.paused


def test_the_watchdog_resumes_a_server_kept_paused_past_the_deadline(capsys):
    launcher, client, s, sync = make(total_s=0.2)

    async def main():
        sync.transaction.watch.mark(["http://s0"], 9, "load")  # a publication that never resumed it
        fatal: list[BaseException] = []
        watch = asyncio.create_task(s.watch(fatal.append))
        while "http://s0" not in client.resumed:
            await asyncio.sleep(0.05)
        watch.cancel()
        return fatal

    assert asyncio.run(asyncio.wait_for(main(), 10)) == []
    assert not sync.transaction.watch.paused
    err = capsys.readouterr().err
    assert "watchdog: rollout server http://s0 was paused for" in err
    assert "publication of v9 (load step" in err


def test_a_server_serving_stale_weights_under_the_new_label_fails_verification():
    launcher, client, s, sync = make(mode="retract")
    client.stale.add("http://s0")
    with pytest.raises(PublicationError) as err:
        asyncio.run(publish(sync, 4))
    assert err.value.step == "verify" and err.value.servers == ["http://s0"]
    assert "stale or partial weights under the new label" in str(err.value)


# ------------------------------------------------------------------ real built-in servers
class Listener:
    """The rollout controller's side of a publication: the versions served, the failure."""

    def __init__(self) -> None:
        self.versions: list[int] = []
        self.failure: BaseException | None = None

    def set_published_version(self, version: int) -> None:
        self.versions.append(version)

    def fail(self, exc: BaseException) -> None:
        self.failure = exc


def perturbed_source(model_dir, seed: int) -> ModelSource:
    model = load_model(model_dir)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return ModelSource(model)


class Trainer(ModelSource):
    """A trainer as publications see it: its weights and its version (its updates)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.version = 0


def test_the_published_version_is_read_from_the_version_clock_alone(tiny_model_dir, tmp_path):
    """One owner of the published version: the WeightSync's VersionClock. It stays at what
    the servers serve while a publication is in flight, moves when every server serves the
    new version (each server reports it), its lag is how far the trainer is ahead, and the
    controller (the listener) is told exactly the clock's versions. maybe_publish publishes
    only at a lag of at least the interval and never after the last step;
    servers_to_trainer closes any lag."""
    launcher = ServerLauncher(ServerSpec(str(tiny_model_dir)), 2, "thread", log_dir=tmp_path)
    trainer = Trainer(load_model(tiny_model_dir))
    listener = Listener()

    async def main(urls):
        async with RolloutClient(urls, timeout=60) as client:
            supervisor = ServerSupervisor(launcher, client, 0)
            sync = WeightSync(
                supervisor, DiskPublisher(), tmp_path / "w", listener, trainer=trainer
            )
            clock = sync.clock
            seen = [(clock.trainer_version, clock.published, clock.lag)]
            trainer.version = 2  # two updates
            held = await sync.maybe_publish(interval=3, last_step=False)  # lag 2 < 3
            seen.append((clock.trainer_version, clock.published, clock.lag, held))
            await sync.maybe_publish(interval=2, last_step=False)  # in the background
            seen.append((clock.trainer_version, clock.published, clock.lag))  # in flight
            await sync.finish()
            seen.append((clock.trainer_version, clock.published, clock.lag))
            served = [(await client.weights_report(u)).version for u in client.urls]
            trainer.version = 3
            held = await sync.maybe_publish(interval=1, last_step=True)  # the run is over
            seen.append((clock.trainer_version, clock.published, clock.lag, held))
            await sync.servers_to_trainer()  # e.g. before an evaluation on the servers
            seen.append((clock.trainer_version, clock.published, clock.lag))
            served += [(await client.weights_report(u)).version for u in client.urls]
            sync.close()
            return seen, served

    with launcher:
        seen, served = asyncio.run(main(launcher.urls))
    assert seen == [(0, 0, 0), (2, 0, 2, 0.0), (2, 0, 2), (2, 2, 0), (3, 2, 1, 0.0), (3, 3, 0)]
    assert served == [2, 2, 3, 3]
    assert listener.versions == [2, 3] and listener.failure is None


class EmptyTrainer:
    """A trainer as publications see it, whose snapshot is an empty directory (the fake
    servers load anything)."""

    model = None

    def __init__(self) -> None:
        self.version = 0

    def save_weights(self, directory: Path) -> Path:
        directory.mkdir(parents=True)
        return directory


def test_the_controller_reads_the_published_version_from_the_one_clock(tmp_path):
    """The published version is held in one object: the VersionClock that WeightSync alone
    advances is the one the rollout controller's admission reads (no copy of its own to
    fall behind it). A publication moves both; so does the clock moved without a word to
    the controller; the controller cannot move it, nor be told another version."""
    trainer = EmptyTrainer()
    clock = VersionClock(trainer)

    async def never(*args):
        raise AssertionError("the controller is not started: admission arithmetic only")

    controller = RolloutController(
        PromptLoader([Problem("p0", "x", "1", "math")], seed=0),
        ControllerOptions(
            n_samples=2, prompts_per_step=4, staleness=StalenessBound(1), max_new_tokens=4
        ),
        never,
        never,
        encode=lambda problem: [1],
        decode=str,
        published=clock,
    )
    launcher = FakeLauncher(2)
    supervisor = ServerSupervisor(launcher, FakeClient(launcher), 3)
    sync = WeightSync(
        supervisor,
        DiskPublisher(),
        tmp_path,
        controller,
        trainer=trainer,
        verify=False,
        clock=clock,
    )
    seen = [(controller.published_version, controller.capacity())]
    trainer.version = 2
    asyncio.run(sync.publish(wait=True))
    seen.append((controller.published_version, controller.capacity()))
    clock.advance(3)  # as WeightSync does, before it tells the controller
    seen.append((controller.published_version, controller.capacity()))
    assert sync.clock is clock and clock.published == 3
    assert seen == [(0, (0 + 1 + 1) * 4), (2, (2 + 1 + 1) * 4), (3, (3 + 1 + 1) * 4)]
    assert controller.failure is None and controller.consumed_version == 0
    with pytest.raises(AttributeError, match="read from the publisher's clock"):
        controller.published_version = 4
    with pytest.raises(ValueError, match="told that the servers serve v4, but the clock"):
        controller.set_published_version(4)
    assert clock.published == 3


@pytest.mark.parametrize("transport", ["disk", "broadcast"])
def test_a_server_that_keeps_stale_weights_under_the_new_label_fails_the_run(
    transport, tiny_model_dir, tmp_path, monkeypatch
):
    """A faulty built-in engine takes each new version label but keeps its old weights (the
    failure a label check cannot see): the first publication passes (the server is honest
    then), the second fails at its verify step naming the server and the version, and the
    controller hears of it."""
    load = Engine._update_weights
    faulty = {"on": False}

    def stale_update(self, state, version, keep_kv):
        if faulty["on"]:
            state = {n: p.detach().clone() for n, p in self.runner.model.named_parameters()}
        return load(self, state, version, keep_kv)

    monkeypatch.setattr(Engine, "_update_weights", stale_update)
    launcher = ServerLauncher(ServerSpec(str(tiny_model_dir)), 1, "thread", log_dir=tmp_path)
    publisher = make_publisher(TrainConfig(weight_transport=transport, broadcast_timeout_s=30.0))
    listener = Listener()

    async def main(urls):
        async with RolloutClient(urls, timeout=60) as client:
            supervisor = ServerSupervisor(launcher, client, 0)
            publication = WeightSync(supervisor, publisher, tmp_path / "w", listener)
            await publication.submit(perturbed_source(tiny_model_dir, 1), 1, wait=True)
            faulty["on"] = True
            await publication.submit(perturbed_source(tiny_model_dir, 2), 2, wait=True)
            publisher.close()

    with launcher:
        asyncio.run(main(launcher.urls))
    assert listener.versions == [1]
    error = listener.failure
    assert isinstance(error, PublicationError) and error.step == "verify", error
    assert error.version == 2 and error.servers == launcher.urls
    assert "stale or partial weights under the new label" in str(error)


def test_the_canary_catches_weights_delivered_but_not_applied(
    tiny_model_dir, tmp_path, monkeypatch
):
    """A faulty built-in engine reports the checksum of the weights it was sent (as the
    vLLM worker extension does) but samples from its old ones, the failure of a tied LM
    head whose cached GEMM handle was never rebuilt: the checksum passes, the canary (every
    publication here) fails naming the server and the version; an honest server passes it
    within 1e-4 nats."""
    load = Engine._update_weights
    sent: dict[str, str] = {}
    faulty = {"on": False}

    def unapplied_update(self, state, version, keep_kv):
        sent["checksum"] = weights_checksum(state.items())
        if faulty["on"]:
            state = {n: p.detach().clone() for n, p in self.runner.model.named_parameters()}
        return load(self, state, version, keep_kv)

    monkeypatch.setattr(Engine, "_update_weights", unapplied_update)
    monkeypatch.setattr(Engine, "weights_checksum", lambda self: sent["checksum"])
    launcher = ServerLauncher(ServerSpec(str(tiny_model_dir)), 1, "thread", log_dir=tmp_path)
    publisher = make_publisher(TrainConfig(weight_transport="disk", broadcast_timeout_s=30.0))
    listener = Listener()

    async def main(urls):
        async with RolloutClient(urls, timeout=60) as client:
            supervisor = ServerSupervisor(launcher, client, 0)
            publication = WeightSync(
                supervisor, publisher, tmp_path / "w", listener, Canary(every=1, tolerance=1e-4)
            )
            await publication.submit(perturbed_source(tiny_model_dir, 1), 1, wait=True)
            honest = (publication.canaries, publication.canary_max_diff)
            faulty["on"] = True
            await publication.submit(perturbed_source(tiny_model_dir, 2), 2, wait=True)
            return honest

    with launcher:
        canaries, max_diff = asyncio.run(main(launcher.urls))
    assert canaries == 1 and max_diff < 1e-4, max_diff
    assert listener.versions == [1]
    error = listener.failure
    assert isinstance(error, PublicationError) and error.step == "canary", error
    assert error.version == 2 and error.servers == launcher.urls
    assert "does not serve the published weights" in str(error)


class TinyLM(torch.nn.Module):
    """A language model small enough for the canary's reference logprobs in a unit test."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 4)
        self.head = torch.nn.Linear(4, 16)

    def forward(self, ids: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.head(self.embed(ids)))


class CanaryClient(FakeClient):
    """Fake servers that sample the canary from ``model`` with the version they loaded;
    ``lost_at_canary``: servers that die as the canary reaches them (after the load)."""

    def __init__(self, launcher: FakeLauncher, model: torch.nn.Module) -> None:
        super().__init__(launcher)
        self.model = model
        self.lost_at_canary: set[str] = set()
        self.canaried: list[str] = []

    async def generate_once(self, input_ids, sampling_params, key=None, url=None) -> Generation:
        self.canaried.append(url)
        if url in self.lost_at_canary:
            self.lost_at_canary.discard(url)
            self.launcher.dead.add(url)
        await self._check([url])
        version = [v for u, _, v in self.loaded if u == url][-1]
        ids = [(7 * k + 1) % 16 for k in range(sampling_params["max_new_tokens"])]
        logprobs = reference_logprobs(self.model, list(input_ids), ids)
        return Generation(ids, logprobs, [version] * len(ids), "length", len(input_ids), url)


def test_a_server_lost_before_the_canary_is_restarted_and_the_canary_repeated(tmp_path):
    """Server 0 dies after loading v1, as the canary reaches it (a Ray node lost just after
    the load step): the canary's unreachable error fails over like a request's. The
    supervisor restarts server 0 (the replacement loads v1), the canary runs again on every
    server and passes, and the publication succeeds; the lost server's error used to stop
    the run while the supervisor was restarting it."""
    model = TinyLM()
    launcher = FakeLauncher(2)
    client = CanaryClient(launcher, model)
    client.lost_at_canary.add("http://s0")
    publisher = DiskPublisher()
    supervisor = ServerSupervisor(launcher, client, 3)
    listener = Listener()
    publication = WeightSync(
        supervisor, publisher, tmp_path / "w", listener, Canary(every=1, tolerance=1e-6)
    )

    async def main():
        await publication.submit(ModelSource(model), 1, wait=True)

    asyncio.run(asyncio.wait_for(main(), 10))
    assert listener.failure is None and listener.versions == [1]
    assert supervisor.restarts == 1 and supervisor.failovers == 1
    assert client.replaced == [("http://s0", "http://s0-r1")]
    assert ("http://s0-r1", str(tmp_path / "w" / "v1"), 1) in client.loaded
    assert client.canaried[-2:] == ["http://s0-r1", "http://s1"]  # the repeated round
    assert publication.canaries == 1 and publication.canary_max_diff == 0.0


class HeldPublisher(DiskPublisher):
    """A broadcast-like transport on the fakes: publications without a disk snapshot are
    'sent' from held weights; :meth:`restart_snapshot` writes one when a restart needs it."""

    written: list[int]

    def __init__(self) -> None:
        self.written = []

    async def transfer(self, client, snapshot, keep_kv):
        await client.update_weights("held", version=snapshot.version, keep_kv=keep_kv)

    def restart_snapshot(self, snapshot):
        if snapshot.path is None:
            self.written.append(snapshot.version)
            snapshot.path = f"/w/v{snapshot.version}-written"
        return snapshot.path


def test_a_restarted_server_never_starts_older_than_the_newest_publication():
    """Issue 35 (step 5, AReaL#1388): v1 has a disk snapshot, v2 was sent from held weights
    only. A server restarted after v2 starts from v2 (written to disk at the restart), not
    from v1: requests routed to it before any catch-up would otherwise carry v1 tokens,
    staler than the bound allows."""
    launcher = FakeLauncher(2)
    client = FaultyClient(launcher)
    publisher = HeldPublisher()
    s = ServerSupervisor(launcher, client, 3)
    sync = WeightSync(s, publisher, Path("/w"))

    async def main():
        await sync.deliver(Snapshot(1, "/w/v1"))
        await sync.deliver(Snapshot(2, None, state={"w": torch.zeros(1)}))
        launcher.dead.add("http://s1")
        return await s.recover("http://s1")

    new = asyncio.run(asyncio.wait_for(main(), 10))
    assert new == "http://s1-r1" and publisher.written == [2]
    assert client.loaded[-1] == ("http://s1-r1", "/w/v2-written", 2)
    assert sync.restart_snapshot == ("/w/v2-written", 2)
    assert all(v >= 2 for url, _, v in client.loaded if url == new)
