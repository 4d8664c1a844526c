"""Keep a run's rollout servers alive: notice a dead or hung server, restart it with the
latest published weights, and let the client resubmit the requests it lost.

Owns: :class:`ServerSupervisor`. It serialises everything that changes which weights the
servers hold — publication (load, with or without an aborting pause) and restarts — behind
one asyncio lock, so a restarted server always loads the newest published version and never
misses one.

How failures are noticed:

* **connection errors**: :meth:`recover` is the :class:`RolloutClient`'s ``recover``
  callback; a request that cannot reach its server awaits it and is resubmitted to the URL
  it returns;
* **exit**: :meth:`watch` polls the server processes;
* **hang**: :meth:`watch` also probes ``GET /health``; a live process that has not answered for
  ``rollout.server_hang_timeout_s`` is killed and restarted (its connections then break and
  its requests fail over).

The watchdog never waits for the lock to look: a server that hangs while a publication holds
the lock (the publication waiting on that very server) is still found and killed, which ends
the publication's wait with a connection error; the publication then restarts the server
itself. Only a server being started (between spawn and healthy) is left alone.

A restart: kill the old process if alive, start a new one on a new port, wait until healthy,
load the newest publication's disk snapshot with its version (when the newest publication
was broadcast only, its held weights are written to disk first: the replacement never starts
older than what was published, so no token it generates is staler than the bound allows),
reroute the client, and tell the weight publisher (``relayrl.launch.publish``: the broadcast
transport re-forms its transfer group under a new name). Restarts are counted over the run;
one more failure than ``rollout.max_server_restarts`` stops the run with a RelayError naming
the server, its exit status, the limit and the log.

What the supervisor needs of the servers and of the client is written down as two
Protocols, :class:`SupervisedServers` (``relayrl.launch.servers.ServerLauncher``, its Ray
subclass and ``ExternalServers`` implement it) and :class:`SupervisedClient`
(``relayrl.engine.client.RolloutClient`` and ``VLLMClient``); the tests' fakes implement the
same two (tests/launch/test_supervisor.py checks both sides against them).

Imports: relayrl.engine.client, relayrl.launch (servers, publish, publication), relayrl.errors.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from relayrl.engine.adapter import Adapter
from relayrl.engine.client import RolloutServerError, WeightsReport
from relayrl.errors import RelayError
from relayrl.launch.publication import Deadlines, PublicationSteps
from relayrl.launch.publish import DiskPublisher, Snapshot, WeightPublisher
from relayrl.launch.servers import healthy

WATCH_INTERVAL_S = 0.5
HEALTH_EVERY_S = 2.0
HEALTH_TIMEOUT_S = 5.0


PUBLISH_MODES = ("retract", "abort", "inflight")

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


class SupervisedClient(Protocol):
    """The rollout client as the supervisor drives it: publication and failover."""

    recover: Callable[[str], Awaitable[str]] | None  # set by the supervisor

    urls: list[str]

    async def pause(self, mode: str = ..., urls: list[str] | None = ...) -> Any:
        """Pause every server, or ``urls`` (``abort``: running requests return, to be
        resubmitted)."""
        ...

    async def continue_generation(self, urls: list[str] | None = ...) -> Any:
        """Resume the servers (or ``urls``) after :meth:`pause`."""
        ...

    async def weights_report(self, url: str) -> WeightsReport:
        """The version the server at ``url`` serves and the checksum of what it loaded."""
        ...

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


class ServerSupervisor:
    """Restarts the launcher's servers for ``client``; see the module docstring."""

    def __init__(
        self,
        launcher: SupervisedServers,
        client: SupervisedClient,
        max_restarts: int,
        hang_timeout_s: float = 60.0,
        publish_mode: str = "retract",
        publisher: WeightPublisher | None = None,
        deadlines: Deadlines | None = None,
        verify: bool = True,
    ) -> None:
        if publish_mode not in PUBLISH_MODES:
            raise ValueError(f"publish_mode must be one of {PUBLISH_MODES}, got {publish_mode!r}")
        self.launcher = launcher
        self.client = client
        self.max_restarts = max_restarts
        self.publish_mode = publish_mode
        self.hang_timeout_s = hang_timeout_s
        # probe at least twice within the hang timeout, each probe bounded by it
        self.probe_every_s = min(HEALTH_EVERY_S, hang_timeout_s / 2)
        self.probe_timeout_s = min(HEALTH_TIMEOUT_S, hang_timeout_s / 2)
        self.restarts = 0
        self.failovers = 0
        self.publisher = publisher or DiskPublisher()
        # one publication attempt: pause -> load -> verify -> resume under its deadlines
        self.steps = PublicationSteps(self.publisher, publish_mode, deadlines, verify)
        self.latest: tuple[Path, int] | None = None  # newest disk snapshot, its version
        self.newest: Snapshot | None = None  # newest publication (disk, broadcast or both)
        self._publishing = False  # a publication holds the lock (and repeats itself)
        self._lock = asyncio.Lock()
        self._moved: dict[str, str] = {}  # old URL -> the URL of its replacement
        self._starting: set[int] = set()  # servers spawned but not yet healthy
        self._killed: dict[str, str] = {}  # URL killed by the watchdog -> why
        # what the watchdog saw of each server at its last look (index -> state)
        self.health: dict[int, str] = {}
        # restarts of each server since the last metrics row (index -> count; row_view)
        self._restarted: dict[int, int] = {}
        client.recover = self.recover

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

    # ------------------------------------------------------------------ weights
    async def publish(
        self,
        path: Path | None,
        version: int,
        state: Mapping[str, Any] | None = None,
        checksum: str | None = None,
        adapter: Adapter | None = None,
    ) -> None:
        """Put publication ``version`` on every server through the weight publisher, under
        ``publish_mode``, as one transaction (``relayrl.launch.publication``): ``path`` is
        its disk snapshot (None: broadcast only), ``state`` its weights to broadcast (None:
        disk only; under LoRA the tensors of ``adapter``, the publication's adapters),
        ``checksum`` what every server must report having loaded. A server
        found unreachable on the way is restarted (with the latest disk snapshot) and the
        publication repeated; so is one the failed attempt could not resume; other errors
        propagate (a PublicationError names the server, the step and the version)."""
        where = Path(path) if path is not None else None
        snapshot = Snapshot(version, where, state, checksum, adapter)
        async with self._lock:
            if snapshot.path is not None:
                self.latest = (snapshot.path, version)
            self.newest = snapshot
            self._publishing = True
            try:
                while True:
                    try:
                        await self.steps.run(self.client, snapshot)
                        if snapshot.path is not None:  # e.g. written by a broadcast fallback
                            self.latest = (snapshot.path, version)
                        return
                    except RolloutServerError as exc:
                        if not exc.unreachable:
                            raise
                        await self._recover_locked(
                            exc.url, "stopped answering during a publication"
                        )
                    except RelayError:
                        await self._restart_unresumed()
                        raise
            finally:
                self._publishing = False

    async def _restart_unresumed(self) -> None:
        """Restart the servers a failed publication left paused (it could not resume them):
        a server is never left paused."""
        for url in self.steps.unresumed:
            if url in self.launcher.urls:
                i = self.launcher.index_of(url)
                self.launcher.kill(i)
                await self._restart(i, "could not be resumed after a failed publication")
        self.steps.unresumed = []

    async def resume_overdue(self) -> list[str]:
        """The watchdog's check of paused servers: a server a publication has kept paused
        for longer than its whole deadline is resumed and reported. Returns the URLs."""
        limit = self.steps.deadlines.total_s
        overdue = self.steps.watch.overdue(limit)
        for url, (seconds, version, step) in overdue.items():
            self.steps.watch.clear([url])
            if url not in self.launcher.urls:
                continue
            print(
                f"watchdog: rollout server {url} was paused for {seconds:.0f}s by the "
                f"publication of v{version} ({step} step, deadline "
                f"train.publish_timeout_s={limit:g}); resuming it",
                file=sys.stderr,
                flush=True,
            )
            try:
                await asyncio.wait_for(
                    self.client.continue_generation([url]), self.steps.deadlines.step_s
                )
            except (RolloutServerError, OSError, asyncio.TimeoutError) as exc:
                print(f"watchdog: resuming {url} failed ({exc!r})", file=sys.stderr, flush=True)
        return list(overdue)

    async def set_restart_snapshot(self, path: Path, version: int) -> None:
        """Make ``path``, a disk snapshot of ``version`` that every server already holds,
        what a restarted server loads (the broadcast transport writes one only every
        ``train.broadcast_snapshot_every`` publications). Under the lock: a restart in
        progress first finishes (its catch-up included) with the previous one."""
        async with self._lock:
            if self.latest is None or self.latest[1] < version:
                self.latest = (Path(path), version)

    # ------------------------------------------------------------------ recovery
    async def recover(self, url: str) -> str:
        """The client's failover callback: where requests for ``url`` should go now."""
        async with self._lock:
            self.failovers += 1
            return await self._recover_locked(url, "could not be reached")

    def _current(self, url: str) -> str:
        while url in self._moved:
            url = self._moved[url]
        return url

    async def _recover_locked(self, url: str, what: str) -> str:
        current = self._current(url)
        if current != url:
            return current  # already restarted by someone else
        i = self.launcher.index_of(url)
        code = self.launcher.exit_code(i)
        if code is None and await asyncio.to_thread(healthy, url, self.probe_timeout_s):
            return url  # a transient error: the caller retries the same server
        reason = self._killed.pop(url, None)
        if reason is None:
            reason = f"exited with code {code}" if code is not None else what
        return await self._restart(i, reason)

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
            self.steps.watch.clear([old])  # a fresh server is not paused
            self.publisher.server_replaced(old, new)
            await self._catch_up()
            return new

    async def _catch_up(self) -> None:
        """After a restart outside a publication: if the newest publication was broadcast
        only, the replacement holds an older disk snapshot; broadcast the newest weights to
        every server again (the others reload the same version)."""
        newest = self.newest
        if self._publishing or newest is None or newest.state is None:
            return
        if self.latest is not None and self.latest[1] >= newest.version:
            return
        await self.steps.run(self.client, newest)

    async def _start_replacement(self, i: int) -> str:
        """A fresh server ``i``, healthy and holding the latest disk snapshot."""
        self._starting.add(i)
        try:
            new = self.launcher.respawn(i)
            await asyncio.to_thread(self.launcher.wait_healthy, [i])
        finally:
            self._starting.discard(i)
        await self._newest_on_disk()
        if self.latest is not None:
            path, version = self.latest
            await self.client.update_weights(str(path), version=version, urls=[new])
        return new

    async def _newest_on_disk(self) -> None:
        """Make the newest publication the restart source: when it was broadcast only, its
        held weights are written to disk now (``WeightPublisher.restart_snapshot``), so a
        replacement starts at the newest version. A replacement that started older would
        be routed requests before the catch-up broadcast reached it, and their tokens would
        carry that older version: staleness past η after a restart (AReaL#1388)."""
        newest = self.newest
        if newest is None or (self.latest is not None and self.latest[1] >= newest.version):
            return
        path = await asyncio.to_thread(self.publisher.restart_snapshot, newest)
        if path is not None:
            self.latest = (path, newest.version)

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
                if (resuming is None or resuming.done()) and self.steps.watch.overdue(
                    self.steps.deadlines.total_s
                ):
                    resuming = asyncio.create_task(self.resume_overdue())
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

    async def _restart_if_current(self, i: int, url: str, reason: str) -> None:
        """Restart server ``i`` unless someone already replaced ``url`` meanwhile."""
        async with self._lock:
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
