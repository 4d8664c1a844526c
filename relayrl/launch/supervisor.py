"""Keep a run's rollout servers alive: notice a dead or hung server, restart it with the
weights it must serve, and let the client resubmit the requests it lost.

Owns: :class:`ServerSupervisor` (restarts and the watchdog) and the three Protocols it is
written against. Which weights the servers serve is not its business but
``relayrl.sync.weight_sync.WeightSync``'s, which it sees only as :class:`ServedWeights`: on a restart it
asks it for the snapshot the replacement loads and tells it of the replacement; its
watchdog asks it which servers a publication has kept paused too long. Everything that
changes which weights the servers hold (a publication, a restart) runs under the
supervisor's one asyncio :attr:`ServerSupervisor.lock`, so a restarted server always loads
the newest published version and never misses one.

How failures are noticed:

* **connection errors**: :meth:`recover` is the :class:`RolloutClient`'s ``recover``
  callback; a request that cannot reach its server awaits it and is resubmitted to the URL
  it returns: the same one only if the server there still proves that it holds the
  client's key (``relayrl.launch.servers.health_state``, the check every server passes at
  its start), else a replacement (a server someone else started cannot be replaced: the run
  stops naming it);
* **exit**: :meth:`watch` polls the server processes;
* **hang**: :meth:`watch` also probes ``GET /health``; a live process that has not answered for
  ``rollout.server_hang_timeout_s`` is killed and restarted (its connections then break and
  its requests fail over).

The watchdog never waits for the lock to look: a server that hangs while a publication holds
the lock (the publication waiting on that very server) is still found and killed, which ends
the publication's wait with a connection error; the publication then has the server
restarted (:meth:`ServerSupervisor.restart_unreachable`, under the lock it holds). Only a
server being started (between spawn and healthy) is left alone.

A restart: kill the old process if alive, start a new one on a new port, wait until healthy,
load :meth:`ServedWeights.restart_source` (the newest publication's disk snapshot with its
version, written first when the newest publication was broadcast only: the replacement never
starts older than what was published, so no token it generates is staler than the bound
allows; without weights to serve, the model directory it started from), reroute the client
(the new URL with the replacement's own key: a restart gets a new one, docs/security.md),
and tell :meth:`ServedWeights.server_replaced` (the broadcast transport re-forms its transfer
group; a broadcast-only publication is caught up). Restarts are counted over the run; one
more failure than ``rollout.max_server_restarts`` stops the run with a RelayError naming the
server, its exit status, the limit and the log.

What the supervisor needs of the servers and of the client is written down as two
Protocols, :class:`SupervisedServers` (``relayrl.launch.servers.ServerLauncher``, its Ray
subclass and ``ExternalServers`` implement it) and :class:`SupervisedClient`
(``relayrl.engine.client.RolloutClient`` and ``VLLMClient``); the tests' fakes implement the
same two (tests/launch/test_supervisor.py checks both sides against them).

Imports: relayrl.engine.client, relayrl.launch.servers, relayrl.errors; never relayrl.sync
(which imports this module).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from relayrl.engine.client import RolloutServerError
from relayrl.errors import RelayError
from relayrl.launch.servers import UNPROVEN, health_state, healthy
from relayrl.launch.servers import UP as PROVEN

WATCH_INTERVAL_S = 0.5
HEALTH_EVERY_S = 2.0
HEALTH_TIMEOUT_S = 5.0

# a server's state as the watchdog last saw it (ServerSupervisor.server_state)
UP, UNANSWERED, RESTARTING, DOWN = "up", "unanswered", "restarting", "down"


class SupervisedServers(Protocol):
    """The rollout servers as the supervisor sees them: server ``i`` is at ``urls[i]``."""

    urls: list[str]

    @property
    def is_process_mode(self) -> bool:
        """Whether the servers are processes that can hang (thread-mode ones are not probed)."""
        ...

    def index_of(self, url: str) -> int:
        """The index of the server at ``url`` (RelayError when none is)."""
        ...

    def exit_code(self, i: int) -> int | None:
        """Server ``i``'s exit status, None while it runs (or when it is not ours)."""
        ...

    def kill(self, i: int) -> None:
        """Kill server ``i`` (a hung one), without waiting for a replacement."""
        ...

    def respawn(self, i: int) -> str:
        """Start a new server ``i`` (the old one is killed); its URL, not yet healthy."""
        ...

    def wait_healthy(self, indices: list[int]) -> None:
        """Block until the servers ``indices`` answer ``/health`` (RelayError after the
        startup timeout or when one exits)."""
        ...

    def describe(self, i: int, what: str, consequence: str = ...) -> str:
        """One error line naming server ``i``, ``what`` happened, the consequence and its log."""
        ...

    def node_of(self, i: int) -> str:
        """Where server ``i`` runs: ``local``, a Ray node's address, an external URL's host."""
        ...

    def key_of(self, i: int) -> str | None:
        """The key server ``i`` holds now (a restarted server holds a new one)."""
        ...


class SupervisedClient(Protocol):
    """The rollout client as the supervisor drives it: failover, and a replacement's
    weights."""

    recover: Callable[[str], Awaitable[str]] | None  # set by the supervisor

    urls: list[str]

    async def update_weights(
        self,
        model_path: str,
        version: int | None = ...,
        urls: list[str] | None = ...,
        keep_kv: bool = ...,
    ) -> Any:
        """Load ``model_path`` as ``version`` on every server (or on ``urls``)."""
        ...

    def replace_url(self, old: str, new: str) -> None:
        """Send what went to ``old`` to ``new`` from now on (a restarted server)."""
        ...

    def set_key(self, url: str, key: str | None) -> None:
        """Send ``key`` to ``url`` from now on (a replacement holds a key of its own)."""
        ...

    def key_for(self, url: str) -> str | None:
        """The key requests to ``url`` carry: what the server there must prove it holds
        before requests go back to it."""
        ...


class ServedWeights(Protocol):
    """Which weights the servers serve, as a restart needs it (``relayrl.sync.weight_sync.WeightSync``
    implements it). Every method is called with :attr:`ServerSupervisor.lock` held, except
    the watchdog's two."""

    async def restart_source(self) -> tuple[Path, int] | None:
        """The disk snapshot a replacement loads and its version (None: the model directory
        the servers started from, version 0)."""
        ...

    async def server_replaced(self, old: str, new: str) -> None:
        """Server ``old`` was replaced by ``new``, which serves :meth:`restart_source`."""
        ...

    def paused_overdue(self) -> bool:
        """Whether a publication has kept a server paused past its deadline (the watchdog
        asks, without the lock)."""
        ...

    async def resume_overdue(self) -> list[str]:
        """Resume the servers :meth:`paused_overdue` found; their URLs."""
        ...


class ServerSupervisor:
    """Restarts the launcher's servers for ``client``; see the module docstring."""

    def __init__(
        self,
        launcher: SupervisedServers,
        client: SupervisedClient,
        max_restarts: int,
        hang_timeout_s: float = 60.0,
    ) -> None:
        self.launcher = launcher
        self.client = client
        self.max_restarts = max_restarts
        self.hang_timeout_s = hang_timeout_s
        # probe at least twice within the hang timeout, each probe bounded by it
        self.probe_every_s = min(HEALTH_EVERY_S, hang_timeout_s / 2)
        self.probe_timeout_s = min(HEALTH_TIMEOUT_S, hang_timeout_s / 2)
        self.restarts = 0
        self.failovers = 0
        self.weights: ServedWeights | None = None  # what a replacement serves (attach)
        # held by every restart and every publication: see the module docstring
        self.lock = asyncio.Lock()
        self._moved: dict[str, str] = {}  # old URL -> the URL of its replacement
        self._starting: set[int] = set()  # servers spawned but not yet healthy
        self._killed: dict[str, str] = {}  # URL killed by the watchdog -> why
        # what the watchdog saw of each server at its last look (index -> state)
        self.health: dict[int, str] = {}
        # restarts of each server since the last metrics row (index -> count; row_view)
        self._restarted: dict[int, int] = {}
        client.recover = self.recover

    def attach(self, weights: ServedWeights) -> None:
        """Restart servers with ``weights``' restart source from now on (one owner)."""
        if self.weights is not None and self.weights is not weights:
            raise RelayError("the rollout servers already have an owner of their weights")
        self.weights = weights

    def stats(self) -> dict[str, float]:
        up = sum(self.server_state(i) == UP for i in range(len(self.launcher.urls)))
        return {
            "server_restarts": float(self.restarts),
            "server_failovers": float(self.failovers),
            "servers_up": float(up),
            "servers_total": float(len(self.launcher.urls)),
        }

    def server_state(self, i: int) -> str:
        """Server ``i`` as last seen: up, unanswered (``/health`` failing, not yet hung),
        restarting, or down (exited or hung, its restart not begun)."""
        if i in self._starting:
            return RESTARTING
        return self.health.get(i, UP)

    def servers_by_node(self) -> str:
        """``2/2 up`` on one node; per node otherwise: ``10.0.0.1 1/1 up, 10.0.0.2 0/1 up
        (1 restarting)``: the dashboard's view of the servers. Restarts since the last
        :meth:`row_view` are counted too, so a restart begun and done between two rows
        still shows: ``1/1 up (1 restarted)``."""
        nodes: dict[str, list[str]] = {}
        restarted: dict[str, int] = {}
        for i in range(len(self.launcher.urls)):
            node = self.launcher.node_of(i)
            nodes.setdefault(node, []).append(self.server_state(i))
            restarted[node] = restarted.get(node, 0) + self._restarted.get(i, 0)
        parts = []
        for node, states in nodes.items():
            text = f"{states.count(UP)}/{len(states)} up"
            others = [f"{states.count(s)} {s}" for s in sorted({s for s in states if s != UP})]
            if restarted[node]:
                others.append(f"{restarted[node]} restarted")
            if others:
                text += " (" + ", ".join(others) + ")"
            parts.append(text if len(nodes) == 1 else f"{node} {text}")
        return ", ".join(parts)

    def row_view(self) -> str:
        """:meth:`servers_by_node` for one metrics row; the restarts it counts are not
        counted again in the next row's (each row's ``N restarted`` adds up to its rise of
        ``server_restarts``)."""
        view = self.servers_by_node()
        self._restarted.clear()
        return view

    # ------------------------------------------------------------------ recovery
    async def recover(self, url: str) -> str:
        """The client's failover callback: where requests for ``url`` should go now."""
        async with self.lock:
            self.failovers += 1
            return await self.restart_unreachable(url, "could not be reached")

    def _current(self, url: str) -> str:
        while url in self._moved:
            url = self._moved[url]
        return url

    async def restart_unreachable(self, url: str, what: str) -> str:
        """Where requests for ``url``, found unreachable, go now: the same server after a
        transient error (it is up and proves that it holds the key), else its replacement
        (restarted because it ``what``). Call with :attr:`lock` held."""
        current = self._current(url)
        if current != url:
            return current  # already restarted by someone else
        i = self.launcher.index_of(url)
        code = self.launcher.exit_code(i)
        state = await self._proven_state(url) if code is None else None
        if state == PROVEN:
            return url  # a transient error: the caller retries the same server
        reason = self._killed.pop(url, None)
        if reason is None:
            reason = f"exited with code {code}" if code is not None else what
        if state == UNPROVEN:
            reason = (
                "answered GET /health without proving that it holds the key: another process "
                "may be listening on its port (the failed requests were not sent back to it)"
            )
        return await self._restart(i, reason)

    async def _proven_state(self, url: str) -> str:
        """``url``'s :func:`~relayrl.launch.servers.health_state` for the client's key: a
        server is sent the failed requests (and the key) again only when it proves it holds
        the key, as at its start; a process that bound the port of a dead server someone
        else started cannot."""
        key = self.client.key_for(url)
        return await asyncio.to_thread(health_state, url, key, self.probe_timeout_s)

    async def _restart(self, i: int, reason: str) -> str:
        """Replace server ``i``; a replacement that fails to come up counts as a restart
        too and is replaced in turn, up to the limit."""
        old = self.launcher.urls[i]
        while True:
            if self.restarts >= self.max_restarts:
                raise RelayError(
                    self.launcher.describe(
                        i,
                        reason,
                        f"it was the limit of rollout.max_server_restarts={self.max_restarts} "
                        f"restarts ({self.restarts} done); the run cannot continue",
                    )
                )
            self.restarts += 1
            self._restarted[i] = self._restarted.get(i, 0) + 1
            note = f"restarting it ({self.restarts}/{self.max_restarts})"
            print(self.launcher.describe(i, reason, note), file=sys.stderr, flush=True)
            try:
                new = await self._start_replacement(i)
            except (RelayError, RolloutServerError, OSError) as exc:
                reason = f"could not be restarted ({exc})"
                continue
            self.client.replace_url(old, new)
            self._moved[old] = new
            if self.weights is not None:
                await self.weights.server_replaced(old, new)
            return new

    async def restart_servers(self, urls: list[str], reason: str) -> None:
        """Kill and restart the servers at ``urls`` that are still current (e.g. ones a
        failed publication could not resume: a server is never left paused). Call with
        :attr:`lock` held."""
        for url in urls:
            if url in self.launcher.urls:
                i = self.launcher.index_of(url)
                self.launcher.kill(i)
                await self._restart(i, reason)

    async def _start_replacement(self, i: int) -> str:
        """A fresh server ``i``, healthy and holding the weights' restart source."""
        self._starting.add(i)
        try:
            new = self.launcher.respawn(i)
            await asyncio.to_thread(self.launcher.wait_healthy, [i])
        finally:
            self._starting.discard(i)
        self.client.set_key(new, self.launcher.key_of(i))  # its own key, not the old one's
        source = await self.weights.restart_source() if self.weights is not None else None
        if source is not None:
            path, version = source
            await self.client.update_weights(str(path), version=version, urls=[new])
        return new

    # ------------------------------------------------------------------ watchdog
    async def watch(self, on_fatal: Callable[[BaseException], None]) -> None:
        """Restart exited or hung servers until cancelled; ``on_fatal(RelayError)`` when a
        server cannot be restarted any more. Looking never waits for the lock (see the module
        docstring); each restart runs in a task of its own that takes it."""
        failing_since: dict[str, float] = {}  # URL -> when /health first went unanswered
        restarts: dict[str, asyncio.Task] = {}  # URL -> the task restarting it
        next_probe = time.monotonic() + self.probe_every_s
        resuming: asyncio.Task | None = None  # the watchdog resuming overdue paused servers
        try:
            while True:
                await asyncio.sleep(WATCH_INTERVAL_S)
                if self._resume_due(resuming):
                    assert self.weights is not None
                    resuming = asyncio.create_task(self.weights.resume_overdue())
                probe = self.launcher.is_process_mode and time.monotonic() >= next_probe
                if probe:
                    next_probe = time.monotonic() + self.probe_every_s
                for url, task in list(restarts.items()):
                    if task.done():
                        del restarts[url]
                        if not task.cancelled() and task.exception() is not None:
                            exc = task.exception()
                            fatal = exc if isinstance(exc, RelayError) else None
                            on_fatal(fatal or RelayError(f"watchdog: {exc!r}"))
                            return
                for i, url in enumerate(list(self.launcher.urls)):
                    if i in self._starting or url in restarts:
                        self.health[i] = RESTARTING
                        continue
                    reason = await self._failure(i, url, probe, failing_since)
                    if reason is None or self.launcher.urls[i] != url:
                        self.health[i] = UNANSWERED if url in failing_since else UP
                        continue
                    self.health[i] = DOWN
                    failing_since.pop(url, None)
                    if self.launcher.exit_code(i) is None:  # hung: kill it now, lock or not
                        self._killed[url] = reason
                        self.launcher.kill(i)
                    restarts[url] = asyncio.create_task(self._restart_if_current(i, url, reason))
        except Exception as exc:  # noqa: BLE001 - the run must hear of any watchdog failure
            on_fatal(exc if isinstance(exc, RelayError) else RelayError(f"watchdog: {exc!r}"))
        finally:
            if resuming is not None:
                resuming.cancel()
            for task in restarts.values():
                if task.done() and not task.cancelled():
                    task.exception()  # retrieved: the run is ending anyway
                task.cancel()

    def _resume_due(self, resuming: asyncio.Task | None) -> bool:
        """Whether the watchdog should resume servers kept paused too long now (no earlier
        resume still running)."""
        if self.weights is None or (resuming is not None and not resuming.done()):
            return False
        return self.weights.paused_overdue()

    async def _restart_if_current(self, i: int, url: str, reason: str) -> None:
        """Restart server ``i`` unless someone already replaced ``url`` meanwhile."""
        async with self.lock:
            if self.launcher.urls[i] == url:
                self._killed.pop(url, None)
                await self._restart(i, reason)

    async def _failure(
        self, i: int, url: str, probe: bool, failing_since: dict[str, float]
    ) -> str | None:
        """Why server ``i`` (at ``url``) must be restarted now, or None."""
        code = self.launcher.exit_code(i)
        if code is not None:
            return self._killed.get(url) or f"exited with code {code}"
        if not probe:
            return None
        asked = time.monotonic()
        if await asyncio.to_thread(healthy, url, self.probe_timeout_s):
            failing_since.pop(url, None)
            return None
        since = failing_since.setdefault(url, asked)
        if time.monotonic() - since >= self.hang_timeout_s:
            return f"did not answer /health for {self.hang_timeout_s:g}s (hung; killed)"
        return None
