"""ServerSupervisor policy against a fake launcher and client: one restart however many
requests notice the failure, the latest weights go to the replacement, a replacement that
fails to start is retried within the limit, publication survives a dead server, and the
limit ends the run with a message naming the server and the setting."""

from __future__ import annotations

import asyncio

import pytest

from relayrl.engine.client import RolloutServerError
from relayrl.errors import RelayError
from relayrl.launch import supervisor as sup
from relayrl.launch.supervisor import ServerSupervisor


class FakeLauncher:
    is_process_mode = True

    def __init__(self, n: int) -> None:
        self.urls = [f"http://s{i}" for i in range(n)]
        self.dead: set[str] = set()
        self.fail_starts = 0  # replacements that will not come up
        self.spawned = 0

    def index_of(self, url: str) -> int:
        return self.urls.index(url)

    def exit_code(self, i: int) -> int | None:
        return -9 if self.urls[i] in self.dead else None

    def respawn(self, i: int) -> str:
        self.spawned += 1
        self.urls[i] = f"http://s{i}-r{self.spawned}"
        return self.urls[i]

    def wait_healthy(self, indices: list[int]) -> None:
        if self.fail_starts:
            self.fail_starts -= 1
            raise RelayError(f"rollout server {indices[0]} did not become healthy")

    def describe(self, i: int, what: str, consequence: str) -> str:
        return f"rollout server {i} ({self.urls[i]}) {what}; {consequence}"


class FakeClient:
    def __init__(self, launcher: FakeLauncher) -> None:
        self.launcher = launcher
        self.recover = None
        self.loaded: list[tuple[str, str, int]] = []
        self.replaced: list[tuple[str, str]] = []

    def _check(self, urls: list[str]) -> None:
        for url in urls:
            if url in self.launcher.dead:
                raise RolloutServerError(url, "unreachable after 4 attempts")

    async def pause(self, mode: str) -> None:
        self._check(self.launcher.urls)

    async def continue_generation(self) -> None:
        self._check(self.launcher.urls)

    async def update_weights(self, path: str, version: int, urls: list[str] | None = None):
        for url in urls or self.launcher.urls:
            self._check([url])
            self.loaded.append((url, path, version))

    def replace_url(self, old: str, new: str) -> None:
        self.replaced.append((old, new))


@pytest.fixture(autouse=True)
def health_from_fake(monkeypatch):
    monkeypatch.setattr(sup, "healthy", lambda url, timeout: "-r" in url)


def make(n: int = 2, max_restarts: int = 3):
    launcher = FakeLauncher(n)
    client = FakeClient(launcher)
    return launcher, client, ServerSupervisor(launcher, client, max_restarts)


def test_many_failed_requests_make_one_restart_with_the_latest_weights():
    launcher, client, s = make()

    async def main():
        await s.publish("/w/v3", 3)
        launcher.dead.add("http://s1")
        return await asyncio.gather(*(s.recover("http://s1") for _ in range(5)))

    urls = asyncio.run(main())
    assert urls == ["http://s1-r1"] * 5
    assert s.restarts == 1 and s.failovers == 5
    assert client.replaced == [("http://s1", "http://s1-r1")]
    assert client.loaded[-1] == ("http://s1-r1", "/w/v3", 3)


def test_transient_error_on_a_healthy_server_restarts_nothing(monkeypatch):
    launcher, client, s = make()
    monkeypatch.setattr(sup, "healthy", lambda url, timeout: True)
    assert asyncio.run(s.recover("http://s0")) == "http://s0"
    assert s.restarts == 0


def test_replacement_that_fails_to_start_is_retried_within_the_limit():
    launcher, client, s = make(max_restarts=3)
    launcher.dead.add("http://s0")
    launcher.fail_starts = 2
    assert asyncio.run(s.recover("http://s0")) == "http://s0-r3"
    assert s.restarts == 3


def test_publication_survives_a_dead_server():
    launcher, client, s = make()
    launcher.dead.add("http://s0")
    asyncio.run(s.publish("/w/v1", 1))
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
