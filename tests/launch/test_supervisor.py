"""ServerSupervisor policy against a fake launcher and client (the fakes, the real launchers
and the real clients implement the supervisor's Protocols, and WeightSync its ServedWeights,
checked here): one restart however many
requests notice the failure, the latest weights go to the replacement, a replacement that
fails to start is retried within the limit, publication survives a dead server, and the
limit ends the run with a message naming the server and the setting. Hangs: a hung server is
killed and restarted, also while a publication is blocked on it (the watchdog must not wait
for the lock the publication holds), and a server still starting up is never taken for hung.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import textwrap
import time
from pathlib import Path

import pytest

from relayrl.engine.client import RolloutClient, RolloutServerError, WeightsReport
from relayrl.engine.vllm_client import VLLMClient
from relayrl.errors import RelayError
from relayrl.launch import supervisor as sup
from relayrl.launch.ray_cluster import RayServerLauncher
from relayrl.launch.servers import DOWN, UNPROVEN, ExternalServers, ServerLauncher
from relayrl.launch.servers import UP as PROVEN
from relayrl.launch.supervisor import (
    ServedWeights,
    ServerSupervisor,
    SupervisedClient,
    SupervisedServers,
)
from relayrl.sync.transports import DiskPublisher, Snapshot
from relayrl.sync.weight_sync import WeightSync


class FakeLauncher:
    is_process_mode = True

    def __init__(self, n: int) -> None:
        self.urls = [f"http://s{i}" for i in range(n)]
        self.dead: set[str] = set()
        self.hung: set[str] = set()  # alive, but answer nothing (SIGSTOP)
        self.killed: list[str] = []
        self.fail_starts = 0  # replacements that will not come up
        self.start_s = 0.0  # how long a replacement takes to become healthy
        self.starting: set[str] = set()
        self.spawned = 0
        self.nodes = ["local"] * n

    def index_of(self, url: str) -> int:
        return self.urls.index(url)

    def exit_code(self, i: int) -> int | None:
        return -9 if self.urls[i] in self.dead else None

    def kill(self, i: int) -> None:
        self.killed.append(self.urls[i])
        self.hung.discard(self.urls[i])
        self.dead.add(self.urls[i])

    def respawn(self, i: int) -> str:
        self.spawned += 1
        self.urls[i] = f"http://s{i}-r{self.spawned}"
        self.starting.add(self.urls[i])
        return self.urls[i]

    def answers(self, url: str) -> bool:
        return not {url} & (self.dead | self.hung | self.starting)

    def wait_healthy(self, indices: list[int]) -> None:
        time.sleep(self.start_s)
        self.starting.discard(self.urls[indices[0]])
        if self.fail_starts:
            self.fail_starts -= 1
            raise RelayError(f"rollout server {indices[0]} did not become healthy")

    def describe(self, i: int, what: str, consequence: str = "the run cannot continue") -> str:
        return f"rollout server {i} ({self.urls[i]}) {what}; {consequence}"

    def node_of(self, i: int) -> str:
        return self.nodes[i]

    def key_of(self, i: int) -> str | None:
        return f"key of {self.urls[i]}"  # each server and restart its own


class FakeClient:
    def __init__(self, launcher: FakeLauncher) -> None:
        self.launcher = launcher
        self.recover = None
        self.api_key: str | None = None
        self.loaded: list[tuple[str, str, int]] = []
        self.replaced: list[tuple[str, str]] = []
        self.calls: list[str] = []
        self.keys: dict[str, str | None] = {}  # URL -> key given by set_key

    async def _check(self, urls: list[str]) -> None:
        """A hung server's request waits until it is killed (no client timeout would end it
        soon: the real one is an hour); a dead one's fails as unreachable."""
        for url in urls:
            while url in self.launcher.hung:
                await asyncio.sleep(0.01)
            if url in self.launcher.dead:
                raise RolloutServerError(url, "unreachable after 4 attempts")

    @property
    def urls(self) -> list[str]:
        return list(self.launcher.urls)

    async def pause(self, mode: str = "abort", urls: list[str] | None = None) -> None:
        self.calls.append(f"pause:{mode}")
        await self._check(urls or list(self.launcher.urls))

    async def continue_generation(self, urls: list[str] | None = None) -> None:
        self.calls.append("continue")
        await self._check(urls or list(self.launcher.urls))

    async def weights_report(self, url: str) -> WeightsReport:
        await self._check([url])
        versions = [v for u, _, v in self.loaded if u == url]
        return WeightsReport(versions[-1] if versions else 0, None)

    async def update_weights(
        self,
        model_path: str,
        version: int | None = None,
        urls: list[str] | None = None,
        keep_kv: bool = False,
    ):
        self.calls.append(f"load:{version}" + (":keep_kv" if keep_kv else ""))
        for url in urls or list(self.launcher.urls):
            await self._check([url])
            self.loaded.append((url, model_path, version))

    def replace_url(self, old: str, new: str) -> None:
        self.replaced.append((old, new))

    def set_key(self, url: str, key: str | None) -> None:
        self.keys[url] = key

    def key_for(self, url: str) -> str | None:
        return self.keys.get(url, self.api_key)


# ---------------------------------------------------------------------------- the Protocols
def protocol_members(protocol: type) -> tuple[set[str], dict[str, object]]:
    """A Protocol's data attributes (annotated) and its methods and properties, by name."""
    data = set(protocol.__annotations__)
    methods = {
        name: value
        for name, value in vars(protocol).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    }
    return data, methods


def assigned_in_init(cls: type) -> set[str]:
    """``self.<name>`` assigned in ``cls.__init__`` (or a base's)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None or not inspect.isfunction(init):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id == "self":
                    names.add(node.attr)
    return names


def shape(function) -> tuple[bool, list[tuple[str, object, bool]]]:
    """Whether ``function`` is a coroutine function, and its parameters after ``self``:
    name, kind, and whether it has a default."""
    params = list(inspect.signature(function).parameters.values())[1:]
    return inspect.iscoroutinefunction(function), [
        (p.name, p.kind, p.default is not inspect.Parameter.empty) for p in params
    ]


def protocol_gaps(cls: type, protocol: type) -> list[str]:
    """How ``cls`` fails to implement ``protocol`` (empty: it implements it)."""
    data, methods = protocol_members(protocol)
    gaps = []
    fields = getattr(cls, "__dataclass_fields__", {})
    for name in sorted(data):
        if not (hasattr(cls, name) or name in fields or name in assigned_in_init(cls)):
            gaps.append(f"{cls.__name__} has no attribute {name}")
    for name, member in sorted(methods.items()):
        mine = inspect.getattr_static(cls, name, None)
        if isinstance(member, property):
            if mine is None or callable(mine):
                gaps.append(f"{cls.__name__}.{name} is not a property or attribute")
        elif not callable(mine):
            gaps.append(f"{cls.__name__} has no method {name}")
        elif shape(mine) != shape(member):
            gaps.append(f"{cls.__name__}.{name}{shape(mine)} is not {shape(member)}")
    return gaps


@pytest.mark.parametrize(
    ("cls", "protocol"),
    [
        (FakeLauncher, SupervisedServers),
        (ServerLauncher, SupervisedServers),
        (RayServerLauncher, SupervisedServers),
        (ExternalServers, SupervisedServers),
        (FakeClient, SupervisedClient),
        (RolloutClient, SupervisedClient),
        (VLLMClient, SupervisedClient),
        (WeightSync, ServedWeights),
    ],
)
def test_fakes_and_real_classes_implement_the_supervisor_protocols(cls, protocol):
    assert protocol_gaps(cls, protocol) == []


def test_protocol_check_finds_a_missing_method_and_a_changed_signature():
    class NoKill(FakeLauncher):
        kill = None

    class OtherLoad(FakeClient):
        async def update_weights(self, model_path: str, version: int) -> None: ...

    assert protocol_gaps(NoKill, SupervisedServers) == ["NoKill has no method kill"]
    assert [gap.split("(")[0] for gap in protocol_gaps(OtherLoad, SupervisedClient)] == [
        "OtherLoad.update_weights"
    ]


def test_the_supervisor_uses_nothing_of_the_servers_or_client_beyond_the_protocols():
    """Every ``self.launcher.<x>`` / ``self.client.<x>`` (and ``client.<x>``) in the
    supervisor's source is a member of its Protocol, so the fakes cover what it uses."""
    tree = ast.parse(inspect.getsource(sup))
    used: dict[str, set[str]] = {"launcher": set(), "client": set(), "weights": set()}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name):
            if owner.value.id == "self" and owner.attr in used:
                used[owner.attr].add(node.attr)
        elif isinstance(owner, ast.Name) and owner.id == "client":
            used["client"].add(node.attr)
    roles = (
        ("launcher", SupervisedServers),
        ("client", SupervisedClient),
        ("weights", ServedWeights),
    )
    for role, protocol in roles:
        data, methods = protocol_members(protocol)
        assert used[role], role
        assert used[role] <= data | set(methods), (role, used[role] - data - set(methods))


# ---------------------------------------------------------------------------- the policy
def health_from_fake_urls(monkeypatch) -> None:
    """Only replacements (``-r`` URLs) answer ``/health``, with the proof of the key."""
    monkeypatch.setattr(sup, "healthy", lambda url, timeout: "-r" in url)
    monkeypatch.setattr(sup, "health_state", lambda url, key, timeout: proven("-r" in url))


def proven(up: bool) -> str:
    return PROVEN if up else DOWN


@pytest.fixture(autouse=True)
def health_from_fake(monkeypatch):
    health_from_fake_urls(monkeypatch)


def make(n: int = 2, max_restarts: int = 3):
    launcher = FakeLauncher(n)
    client = FakeClient(launcher)
    return launcher, client, ServerSupervisor(launcher, client, max_restarts)


def weight_sync(s: ServerSupervisor, mode: str = "retract") -> WeightSync:
    """The owner of the weights of ``s``'s servers: the disk transport, nobody listening."""
    return WeightSync(s, DiskPublisher(), Path("/w"), mode=mode)


def publish(sync: WeightSync, path: str, version: int):
    """Put the disk snapshot ``path`` on every server as ``version``."""
    return sync.deliver(Snapshot(version, path))


def test_many_failed_requests_make_one_restart_with_the_latest_weights():
    launcher, client, s = make()
    sync = weight_sync(s)

    async def main():
        await publish(sync, "/w/v3", 3)
        launcher.dead.add("http://s1")
        return await asyncio.gather(*(s.recover("http://s1") for _ in range(5)))

    urls = asyncio.run(main())
    assert urls == ["http://s1-r1"] * 5
    assert s.restarts == 1 and s.failovers == 5
    assert client.replaced == [("http://s1", "http://s1-r1")]
    assert client.loaded[-1] == ("http://s1-r1", "/w/v3", 3)


@pytest.mark.parametrize(
    ("mode", "calls"),
    [
        ("retract", ["load:4"] * 2),
        ("inflight", ["load:4:keep_kv"] * 2),
        ("abort", ["pause:abort"] * 2 + ["load:4"] * 2 + ["continue"] * 2),
    ],
)
def test_publication_modes_send_the_right_calls(mode, calls):
    """Each step is one call per server (its deadline names the server): retract: a load
    (the servers re-queue running requests themselves); inflight: a load with keep_kv
    (running requests keep their KV); abort: pause with abort, load, continue (the client
    resubmits the aborted requests)."""
    launcher = FakeLauncher(2)
    client = FakeClient(launcher)
    asyncio.run(publish(weight_sync(ServerSupervisor(launcher, client, 3), mode), "/w/v4", 4))
    assert client.calls == calls
    assert client.loaded == [("http://s0", "/w/v4", 4), ("http://s1", "/w/v4", 4)]
    with pytest.raises(ValueError, match="publish_mode"):
        weight_sync(ServerSupervisor(launcher, client, 3), "drain")


def every_server_proves_its_key(monkeypatch) -> list[tuple[str, str | None]]:
    """Make every proof the supervisor asks for pass; the (URL, key) of each, in order."""
    asked: list[tuple[str, str | None]] = []

    def health_state(url: str, key: str | None, timeout: float) -> str:
        asked.append((url, key))
        return PROVEN

    monkeypatch.setattr(sup, "health_state", health_state)
    return asked


def test_transient_error_on_a_healthy_server_restarts_nothing(monkeypatch):
    launcher, client, s = make()
    client.api_key = "k"
    asked = every_server_proves_its_key(monkeypatch)
    assert asyncio.run(s.recover("http://s0")) == "http://s0"
    assert s.restarts == 0 and asked == [("http://s0", "k")]


def test_a_server_that_answers_without_the_proof_of_the_key_gets_no_request_back(
    monkeypatch, capsys
):
    """After a connection error, ``http://s0`` answers ``/health`` but cannot prove that it
    holds the key (another process on its port): its requests go to a replacement."""
    launcher, client, s = make()
    monkeypatch.setattr(
        sup, "health_state", lambda url, key, timeout: PROVEN if "-r" in url else UNPROVEN
    )
    assert asyncio.run(s.recover("http://s0")) == "http://s0-r1"
    assert s.restarts == 1 and client.replaced == [("http://s0", "http://s0-r1")]
    assert "rollout server 0 (http://s0) answered GET /health without proving that it holds " in (
        capsys.readouterr().err
    )


def test_a_replacement_is_sent_its_own_key_and_must_prove_that_one(monkeypatch):
    """A restarted server holds a key of its own (docs/security.md): the client sends it
    from the replacement's first request (its weights' load) on, and the proof asked of
    the replacement after a later connection error is the proof of that key."""
    launcher, client, s = make()
    keys_at_load: list[str | None] = []
    update_weights = client.update_weights

    async def loading(model_path, version=None, urls=None, keep_kv=False):
        keys_at_load.extend(client.key_for(url) for url in urls or [])
        await update_weights(model_path, version, urls, keep_kv)

    client.update_weights = loading
    sync = weight_sync(s)
    asyncio.run(publish(sync, "/w/v1", 1))
    keys_at_load.clear()
    launcher.dead.add("http://s0")
    asyncio.run(s.recover("http://s0"))
    assert keys_at_load == ["key of http://s0-r1"]  # the restart's load, with the new key
    asked = every_server_proves_its_key(monkeypatch)
    assert asyncio.run(s.recover("http://s0-r1")) == "http://s0-r1"
    assert asked == [("http://s0-r1", "key of http://s0-r1")]


def test_replacement_that_fails_to_start_is_retried_within_the_limit():
    launcher, client, s = make(max_restarts=3)
    launcher.dead.add("http://s0")
    launcher.fail_starts = 2
    assert asyncio.run(s.recover("http://s0")) == "http://s0-r3"
    assert s.restarts == 3


def test_publication_survives_a_dead_server():
    launcher, client, s = make()
    launcher.dead.add("http://s0")
    asyncio.run(publish(weight_sync(s), "/w/v1", 1))
    assert s.restarts == 1
    assert ("http://s0-r1", "/w/v1", 1) in client.loaded and (
        "http://s1",
        "/w/v1",
        1,
    ) in client.loaded


def test_limit_reached_stops_with_a_clear_message():
    launcher, client, s = make(max_restarts=1)
    launcher.dead.add("http://s0")
    launcher.fail_starts = 5
    with pytest.raises(RelayError) as err:
        asyncio.run(s.recover("http://s0"))
    message = str(err.value)
    assert message.startswith("rollout server 0") and "could not be restarted" in message
    assert "rollout.max_server_restarts=1" in message and "cannot continue" in message


def test_watch_restarts_an_exited_server_and_reports_the_limit(monkeypatch):
    monkeypatch.setattr(sup, "WATCH_INTERVAL_S", 0.01)
    launcher, client, s = make(max_restarts=1)
    fatal: list[BaseException] = []

    async def main():
        task = asyncio.create_task(s.watch(fatal.append))
        launcher.dead.add("http://s1")
        while s.restarts < 1:
            await asyncio.sleep(0.01)
        launcher.dead.add(launcher.urls[1])  # the replacement dies too
        await asyncio.wait_for(task, 5)

    asyncio.run(main())
    assert client.replaced == [("http://s1", "http://s1-r1")]
    assert len(fatal) == 1 and "max_server_restarts=1" in str(fatal[0])


def make_watched(monkeypatch, n: int = 2, max_restarts: int = 3):
    """A supervisor with a 0.2 s hang timeout whose health probe asks the fake launcher."""
    monkeypatch.setattr(sup, "WATCH_INTERVAL_S", 0.01)
    launcher = FakeLauncher(n)
    client = FakeClient(launcher)
    monkeypatch.setattr(sup, "healthy", lambda url, timeout: launcher.answers(url))
    return launcher, client, ServerSupervisor(launcher, client, max_restarts, hang_timeout_s=0.2)


def test_watch_kills_and_restarts_a_hung_server(monkeypatch, capsys):
    launcher, client, s = make_watched(monkeypatch)
    fatal: list[BaseException] = []

    async def main():
        task = asyncio.create_task(s.watch(fatal.append))
        launcher.hung.add("http://s1")
        while s.restarts < 1 or "http://s1" in client.launcher.urls:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # nothing more happens
        task.cancel()

    asyncio.run(asyncio.wait_for(main(), 10))
    assert not fatal and s.restarts == 1 and launcher.killed == ["http://s1"]
    assert client.replaced == [("http://s1", "http://s1-r1")]
    assert "did not answer /health for 0.2s (hung; killed)" in capsys.readouterr().err


def test_server_hung_during_a_publication_is_killed_and_the_publication_completes(
    monkeypatch, capsys
):
    """The publication holds the lock while it waits for the hung server; the watchdog
    still finds the hang and kills the server, and the publication restarts it (a watchdog
    that waited for the lock left the run waiting on the hung server for the client's
    one-hour timeout)."""
    launcher, client, s = make_watched(monkeypatch)
    sync = weight_sync(s)
    fatal: list[BaseException] = []

    async def main():
        task = asyncio.create_task(s.watch(fatal.append))
        launcher.hung.add("http://s0")
        await asyncio.wait_for(publish(sync, "/w/v2", 2), 10)
        await asyncio.sleep(0.3)  # the watchdog's own restart task finds it done
        task.cancel()

    asyncio.run(main())
    assert not fatal and s.restarts == 1 and launcher.killed == ["http://s0"]
    assert ("http://s0-r1", "/w/v2", 2) in client.loaded
    assert ("http://s1", "/w/v2", 2) in client.loaded
    assert "(hung; killed); restarting it (1/3)" in capsys.readouterr().err


def test_a_replacement_still_starting_is_not_taken_for_hung(monkeypatch):
    launcher, client, s = make_watched(monkeypatch)
    launcher.start_s = 1.0  # five hang timeouts without answering /health while it starts
    fatal: list[BaseException] = []

    async def main():
        task = asyncio.create_task(s.watch(fatal.append))
        launcher.dead.add("http://s0")
        while s.restarts < 1 or launcher.starting:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)
        task.cancel()

    asyncio.run(asyncio.wait_for(main(), 10))
    assert not fatal and s.restarts == 1 and launcher.killed == []
    assert client.replaced == [("http://s0", "http://s0-r1")]


def test_the_watchdog_reports_each_server_per_node_unanswered_restarting_and_up(monkeypatch):
    """What the dashboard shows: per node, how many servers are up, and what the others are
    doing, as the watchdog saw them (a hang is first unanswered, then restarting, then up)."""
    launcher, client, s = make_watched(monkeypatch, n=3)
    launcher.nodes = ["10.0.0.1", "10.0.0.2", "10.0.0.2"]
    launcher.start_s = 0.5
    seen: list[tuple[str, dict[str, float]]] = []

    def look() -> None:
        view = (s.servers_by_node(), s.stats())
        if not seen or seen[-1][0] != view[0]:
            seen.append(view)

    async def main():
        task = asyncio.create_task(s.watch(lambda exc: None))
        await asyncio.sleep(0.05)
        look()
        launcher.hung.add("http://s2")
        while s.restarts < 1 or launcher.starting:
            look()
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.1)
        look()
        task.cancel()

    asyncio.run(asyncio.wait_for(main(), 10))
    views = [v for v, _ in seen]
    restarting = "10.0.0.1 1/1 up, 10.0.0.2 1/2 up (1 restarting, 1 restarted)"
    assert views[0] == "10.0.0.1 1/1 up, 10.0.0.2 2/2 up"
    assert "10.0.0.1 1/1 up, 10.0.0.2 1/2 up (1 unanswered)" in views
    assert restarting in views
    assert views[-1] == "10.0.0.1 1/1 up, 10.0.0.2 2/2 up (1 restarted)"
    ups = {v: stats["servers_up"] for v, stats in seen}
    assert ups[views[0]] == 3 and ups[restarting] == 2 and ups[views[-1]] == 3
    assert all(stats["servers_total"] == 3 for _, stats in seen)
    assert s.row_view() == views[-1] and s.servers_by_node() == views[0]  # counted once
    one_node = FakeLauncher(2)
    assert ServerSupervisor(one_node, FakeClient(one_node), 1).servers_by_node() == "2/2 up"


def test_each_metrics_row_shows_the_restarts_since_the_row_before():
    """A restart begun and finished between two metrics rows (a killed Ray actor respawned
    within one step) is on the next row's view, ``(N restarted)`` on its node, and on no
    later row: each row's count is its rise of ``server_restarts``, whatever the timing. A
    replacement that failed to start counts too (two restarts for one loss)."""
    launcher, client, s = make(n=3)
    launcher.nodes = ["10.0.0.1", "10.0.0.2", "10.0.0.2"]
    rows = [(s.row_view(), s.stats()["server_restarts"])]

    async def lose(url: str, failed_starts: int = 0) -> None:
        launcher.dead.add(url)
        launcher.fail_starts = failed_starts
        await s.recover(url)

    asyncio.run(lose("http://s2"))
    rows.append((s.row_view(), s.stats()["server_restarts"]))
    rows.append((s.row_view(), s.stats()["server_restarts"]))
    asyncio.run(lose("http://s0", failed_starts=1))
    rows.append((s.row_view(), s.stats()["server_restarts"]))
    assert rows == [
        ("10.0.0.1 1/1 up, 10.0.0.2 2/2 up", 0),
        ("10.0.0.1 1/1 up, 10.0.0.2 2/2 up (1 restarted)", 1),
        ("10.0.0.1 1/1 up, 10.0.0.2 2/2 up", 1),
        ("10.0.0.1 1/1 up (2 restarted), 10.0.0.2 2/2 up", 3),
    ]
