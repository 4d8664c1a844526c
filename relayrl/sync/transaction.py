"""Weight publication as a transaction with one owner and one deadline (docs/engine.md
"Publication", docs/cluster.md "Weight transports").

Owns: :class:`Transaction` (one attempt: pause → load → verify → resume on every server,
each step under a deadline, :func:`run_step`), :class:`PublishMode`
(``train.publish_mode``), :class:`PauseWatch` (which servers a publication has paused, since
when: the supervisor's watchdog has ``relayrl.sync.weight_sync.WeightSync`` resume one paused past the
deadline), :class:`Deadlines`, :class:`PublicationError`, :func:`snapshot_checksum` and
:func:`remove_older_snapshots`. Who runs it, one publication after the other and around
restarts, is :class:`relayrl.sync.weight_sync.WeightSync`.

The transaction, for publication ``v``:

1. **snapshot** (trainer side, the trainer held): the publisher's snapshot and the checksum of
   the weights published (``weights_checksum`` over the snapshot's tensors);
2. **pause** (``train.publish_mode=abort`` only): every server pauses, aborting its running
   requests (the client resubmits them after the resume);
3. **load**: the weight transport puts ``v`` on every server and labels new tokens ``v``
   (``relayrl.sync.transports``; vLLM servers pause around the load themselves);
4. **verify**: each server reports the version it serves and the checksum of the weights it
   loaded (built-in servers: over the model's own parameters; vLLM servers: over the tensors
   the worker extension loaded); a wrong version or checksum fails the publication naming the
   server: a server that kept stale weights under the new label cannot pass;
5. **resume** (any server that may have been paused);
6. **canary** (the first publication, then every ``train.publish_canary_every``-th): each
   server samples a few tokens after a fixed prompt, and their logprobs must equal the
   trainer's under the published weights (a copy of the trainer's model taken with the
   snapshot) within ``train.publish_canary_tolerance`` (``relayrl.sync.canary``): the checksum proves the weights
   were delivered, the canary that the server samples from them (e.g. a load that reached
   the checkpoint tensors but not a tied LM head's cached GEMM handle). The checksum catches
   a one-step-stale server exactly; the canary only a difference above its tolerance.
   A server the canary cannot reach is restarted by the supervisor (loading this
   publication) and the canary runs again, as a request fails over.

Every step runs per server under ``min(train.publish_step_timeout_s, what is left of
train.publish_timeout_s)``; a step past it is *not awaited further* (its task is cancelled
and left behind, so no wait of the run is unbounded). Every exit path resumes what may be
paused: success (the resume step), an error or a timeout (the servers are resumed under the
step deadline; one that cannot be resumed is reported in :attr:`Transaction.unresumed`,
which ``WeightSync`` has the supervisor restart), a cancellation (the run ending: resumed under the deadline,
best effort), a server restarted mid-way (``WeightSync`` repeats the whole transaction on
the new server list; a fresh server is not paused). A failure other than an unreachable
server (which the supervisor restarts, then repeats the publication) is one
:class:`PublicationError`: ``publication of weights v7: rollout server URL: load step: ...``.

Imports: relayrl.engine (adapter, client, weights), relayrl.errors and the transports'
base (``relayrl.sync.transports.base``).
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from relayrl.engine.adapter import is_adapter_snapshot, read_adapter
from relayrl.engine.client import RolloutClient, RolloutServerError
from relayrl.engine.weights import read_state_dict, served_checksum
from relayrl.errors import RelayError
from relayrl.sync.transports.base import Snapshot, WeightPublisher

STEPS = ("snapshot", "pause", "load", "verify", "resume", "canary")


class PublishMode(str, Enum):
    """``train.publish_mode``: what a publication does to the requests running on a server.
    ``retract``: the server re-queues them itself (their KV recomputed under the new
    weights); ``abort``: every server is paused first, aborting them (the client resubmits
    them after the resume); ``inflight``: they keep their KV and continue."""

    RETRACT = "retract"
    ABORT = "abort"
    INFLIGHT = "inflight"

    @classmethod
    def of(cls, mode: str | PublishMode) -> PublishMode:
        """``mode`` as a :class:`PublishMode`; a ValueError naming the choices otherwise."""
        try:
            return cls(mode)
        except ValueError:
            choices = tuple(m.value for m in cls)
            raise ValueError(f"publish_mode must be one of {choices}, got {mode!r}") from None


@dataclass(frozen=True)
class Deadlines:
    """``step_s``: each step of a publication (``train.publish_step_timeout_s``);
    ``total_s``: the whole of one attempt (``train.publish_timeout_s``)."""

    step_s: float = 300.0
    total_s: float = 900.0

    def __post_init__(self) -> None:
        if self.step_s <= 0 or self.total_s <= 0:
            raise ValueError(f"deadlines must be > 0, got {self}")


class PublicationError(RelayError):
    """A publication failed: names the version, the step and the server(s)."""

    def __init__(self, version: int, step: str, servers: list[str], why: str) -> None:
        where = ", ".join(servers) if servers else "every server"
        super().__init__(
            f"publication of weights v{version}: rollout server(s) {where}: {step} step: {why}"
        )
        self.version, self.step, self.servers = version, step, list(servers)


def remove_older_snapshots(root: Path, version: int) -> list[Path]:
    """Delete the published weight snapshots ``root/v<k>`` with ``k < version`` (the servers
    have loaded ``version``); nothing else under ``root`` is touched. Returns what went."""
    removed = []
    for old in root.glob("v*"):
        if old.is_dir() and old.name[1:].isdigit() and int(old.name[1:]) < version:
            shutil.rmtree(old, ignore_errors=True)
            removed.append(old)
    return sorted(removed)


def snapshot_checksum(snapshot: Snapshot, served_dtype: torch.dtype | None = None) -> str | None:
    """``weights_checksum`` of what ``snapshot`` publishes (its tensors, else its disk
    snapshot's; an adapter snapshot's: the merged weights' the trainer recorded in it), None
    when it holds neither. ``served_dtype``: the servers hold the weights in this dtype
    (``rollout.dtype``), so the checksum is of the tensors rounded to it, as loading does."""
    if snapshot.adapter is not None:
        return snapshot.adapter.checksum
    if snapshot.path is not None and is_adapter_snapshot(snapshot.path):
        return read_adapter(snapshot.path).checksum
    if snapshot.state is not None:
        state = snapshot.state
    elif snapshot.path is not None:
        state = read_state_dict(snapshot.path)
    else:
        return None
    return served_checksum(state.items(), served_dtype)


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # a task left behind: its outcome is superseded


def abandon(task: asyncio.Future) -> None:
    """Stop awaiting ``task``: cancel it and let its outcome, when it comes, go unread
    (no "exception was never retrieved"). A task already done is only read."""
    task.cancel()
    task.add_done_callback(_retrieve)


@dataclass
class PauseWatch:
    """The servers a publication may have paused: URL -> (since, version, step)."""

    paused: dict[str, tuple[float, int, str]] = field(default_factory=dict)

    def mark(self, urls: list[str], version: int, step: str) -> None:
        now = time.monotonic()
        for url in urls:
            self.paused.setdefault(url, (now, version, step))

    def clear(self, urls: list[str]) -> None:
        for url in urls:
            self.paused.pop(url, None)

    def overdue(self, limit_s: float) -> dict[str, tuple[float, int, str]]:
        """The servers paused for longer than ``limit_s``: URL -> (seconds, version, step)."""
        now = time.monotonic()
        return {
            url: (now - since, version, step)
            for url, (since, version, step) in self.paused.items()
            if now - since > limit_s
        }


class Transaction:
    """One attempt of a publication on one client; see the module docstring."""

    def __init__(
        self,
        publisher: WeightPublisher,
        mode: str | PublishMode = PublishMode.RETRACT,
        deadlines: Deadlines | None = None,
        verify: bool = True,
    ) -> None:
        self.publisher = publisher
        self.mode = PublishMode.of(mode)
        self.deadlines = deadlines or Deadlines()
        self.verify = verify
        self.watch = PauseWatch()
        self.unresumed: list[str] = []  # servers the last failed attempt could not resume

    async def run(self, client: RolloutClient, snapshot: Snapshot) -> None:
        """Publish ``snapshot`` on every server of ``client``, or raise (see the module
        docstring: a :class:`RolloutServerError` for an unreachable server, else a
        :class:`PublicationError`)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.deadlines.total_s
        urls, version = list(client.urls), snapshot.version
        self.unresumed = []
        resumed = False
        try:
            if self.mode is PublishMode.ABORT:
                self.watch.mark(urls, version, "pause")
                calls = {u: client.pause("abort", [u]) for u in urls}
                await run_step(self.deadlines, end, version, "pause", calls)
            if getattr(client, "PAUSES_TO_LOAD", False):
                self.watch.mark(urls, version, "load")
            await run_step(self.deadlines, end, version, "load", self._load_calls(client, snapshot))
            if (
                self.mode is not PublishMode.ABORT
            ):  # a client that paused to load has resumed by now
                self.watch.clear(urls)
            if self.verify:
                calls = {u: self._verify(client, u, snapshot) for u in urls}
                await run_step(self.deadlines, end, version, "verify", calls)
            await self._resume(end, client, version, urls)
            resumed = True
        finally:
            if not resumed:
                await self._resume_after_failure(client, version, urls)

    def _load_calls(self, client: RolloutClient, snapshot: Snapshot) -> dict[str, Awaitable]:
        keep_kv = self.mode is PublishMode.INFLIGHT
        return self.publisher.load_calls(client, snapshot, keep_kv=keep_kv)

    async def _verify(self, client: RolloutClient, url: str, snapshot: Snapshot) -> None:
        report = await client.weights_report(url)
        if report.version != snapshot.version:
            raise PublicationError(
                snapshot.version, "verify", [url], f"it serves version {report.version}"
            )
        expected = snapshot.checksum
        if expected is not None and report.checksum is not None and report.checksum != expected:
            raise PublicationError(
                snapshot.version,
                "verify",
                [url],
                f"it loaded weights with checksum {report.checksum[:16]}…, not the "
                f"published {expected[:16]}… (stale or partial weights under the new label)",
            )

    async def _resume(self, end: float, client: RolloutClient, version: int, urls: list[str]):
        paused = [u for u in urls if u in self.watch.paused]
        if paused:
            calls = {u: client.continue_generation([u]) for u in paused}
            await run_step(self.deadlines, end, version, "resume", calls)
            self.watch.clear(paused)

    async def _resume_after_failure(
        self, client: RolloutClient, version: int, urls: list[str]
    ) -> None:
        """The exit path of a failed, timed-out or cancelled attempt: resume every server it
        may have paused, under one step deadline; those that cannot be resumed are left in
        :attr:`unresumed` (``WeightSync`` has the supervisor restart them)."""
        paused = [u for u in urls if u in self.watch.paused and u in client.urls]
        self.watch.clear([u for u in urls if u not in client.urls])  # replaced meanwhile
        if not paused:
            return
        tasks = {asyncio.ensure_future(client.continue_generation([u])): u for u in paused}
        done, pending = await asyncio.wait(tasks, timeout=self.deadlines.step_s)
        for task in pending:
            abandon(task)
        ok = [tasks[t] for t in done if not t.cancelled() and t.exception() is None]
        self.watch.clear(ok)
        self.unresumed = [u for u in paused if u not in ok]
        if self.unresumed:
            print(
                f"warning: publication v{version}: could not resume {', '.join(self.unresumed)} "
                "after the publication failed; restarting it",
                file=sys.stderr,
                flush=True,
            )


async def run_step(
    deadlines: Deadlines, end: float, version: int, step: str, calls: Mapping[str, Awaitable[Any]]
) -> None:
    """Run one step's per-server ``calls`` (label -> awaitable) under its deadline:
    ``deadlines.step_s``, or what is left until ``end`` (the loop time the whole attempt
    must end by) when that is less. A server found unreachable raises its
    :class:`RolloutServerError` (the caller restarts it and repeats the publication); any
    other failure or a call past the deadline is a :class:`PublicationError` naming the
    step and the server(s)."""
    limit = min(deadlines.step_s, end - asyncio.get_running_loop().time())
    tasks = {asyncio.ensure_future(c): label for label, c in calls.items()}
    if limit <= 0:
        done, pending = set(), set(tasks)
    else:
        done, pending = await asyncio.wait(
            tasks, timeout=limit, return_when=asyncio.FIRST_EXCEPTION
        )
    for task in pending:
        abandon(task)
    errors = [(tasks[t], t.exception()) for t in done if not t.cancelled() and t.exception()]
    for _, exc in errors:
        if isinstance(exc, RolloutServerError) and exc.unreachable:
            raise exc  # the supervisor restarts the server and the publication is repeated
    for label, exc in errors:
        if isinstance(exc, PublicationError):
            raise exc
        raise PublicationError(version, step, [label], str(exc)) from exc
    if pending:
        which = (
            f"train.publish_step_timeout_s={deadlines.step_s:g}"
            if limit >= deadlines.step_s
            else f"train.publish_timeout_s={deadlines.total_s:g} (the whole publication)"
        )
        raise PublicationError(
            version, step, [tasks[t] for t in pending], f"no answer within {which}"
        )


__all__ = [
    "STEPS",
    "Deadlines",
    "PauseWatch",
    "PublicationError",
    "PublishMode",
    "Transaction",
    "abandon",
    "remove_older_snapshots",
    "run_step",
    "snapshot_checksum",
]
