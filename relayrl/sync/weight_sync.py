"""The one owner of which weights a live run's rollout servers serve.

Owns: :class:`WeightSync`, :class:`PublicationListener`, :func:`publish_interval` and
:data:`EXIT_PUBLICATION_WAIT_S`. ``WeightSync`` takes the trainer's weights (the snapshot,
while the trainer is held) and puts them on every server in the background, one
publication after the other and in version order, each as one transaction
(``relayrl.sync.transaction``: pause → load → verify → resume under deadlines, then the
canary of ``relayrl.sync.canary`` when due). It holds what the rest of the run asks of the
servers' weights:

* the published version, in its :class:`~relayrl.sync.clock.VersionClock` (advanced when a
  publication has ended; the rollout controller reads that clock, the run's one, and is
  told to look again: its admission bound moves up);
* the snapshot a restarted server loads (:meth:`WeightSync.restart_source`: the newest
  publication's disk snapshot, written first when it was broadcast only), which the
  supervisor asks for on every restart (it sees ``WeightSync`` as its
  ``relayrl.launch.supervisor.ServedWeights``), and the catch-up broadcast after a restart;
* the servers a publication has kept paused, which the supervisor's watchdog has it resume.

A publication and a restart never interleave: both run under the supervisor's lock. A server
found unreachable during a publication is restarted by the supervisor (loading the restart
source) and the publication repeated; one a failed publication could not resume is restarted.

Imports: relayrl.config (the train section), relayrl.engine.client, relayrl.errors,
relayrl.launch.supervisor, relayrl.metric_names and this package's transaction, canary,
clock and transports.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Protocol

import torch

from relayrl.config.schema import TrainConfig
from relayrl.engine.client import RolloutServerError
from relayrl.errors import RelayError
from relayrl.launch.supervisor import ServerSupervisor
from relayrl.metric_names import PUBLICATIONS, PUBLISH_LATENCY_MEAN_S, WEIGHT_TRANSPORT
from relayrl.sync.canary import Canary, CanaryCheck
from relayrl.sync.clock import VersionClock
from relayrl.sync.transaction import (
    Deadlines,
    PublishMode,
    Transaction,
    abandon,
    remove_older_snapshots,
    snapshot_checksum,
)
from relayrl.sync.transports.base import Snapshot, WeightPublisher, WeightSource

# how long the run, ending, waits for a cancelled publication to leave the servers resumed
EXIT_PUBLICATION_WAIT_S = 30.0


def publish_interval(publish_every: int, eta: int) -> int:
    """Steps between publications: ``publish_every``, capped at η + 1 (no starvation)."""
    return max(1, min(publish_every, eta + 1))


class PublicationListener(Protocol):
    """Who hears of publications (the rollout controller): its admission bound moves up
    when the servers serve a version (told after the clock has advanced to it); a failure
    stops the run."""

    def set_published_version(self, version: int) -> None: ...

    def fail(self, exc: BaseException) -> None: ...

    @property
    def failure(self) -> BaseException | None:
        """The error given to :meth:`fail` (or a stop), if any."""
        ...


class Trainer(WeightSource, Protocol):
    """The trainer as publications see it: its weights and its version."""

    version: int


class WeightSync:
    """See the module docstring. ``listener``: who hears of each publication (None: a
    failed publication's error is raised by :meth:`finish`); ``trainer``: whose weights
    :meth:`publish` publishes (the clock's trainer version is its); ``clock``: the run's
    :class:`VersionClock` over ``trainer``, which the listener reads too (None: a new one)."""

    def __init__(
        self,
        supervisor: ServerSupervisor,
        publisher: WeightPublisher,
        root: Path,
        listener: PublicationListener | None = None,
        canary: Canary | None = None,
        *,
        trainer: Trainer | None = None,
        mode: str | PublishMode = PublishMode.RETRACT,
        deadlines: Deadlines | None = None,
        verify: bool = True,
        served_dtype: torch.dtype | None = None,
        clock: VersionClock | None = None,
    ) -> None:
        self.supervisor, self.publisher, self.root = supervisor, publisher, root
        self.listener, self.trainer = listener, trainer
        self.clock = clock if clock is not None else VersionClock(trainer)  # its one writer
        # one attempt of a publication: pause -> load -> verify -> resume under deadlines
        self.transaction = Transaction(publisher, mode, deadlines, verify)
        self.canary = CanaryCheck(
            canary or Canary(every=0), supervisor, self.transaction.deadlines, served_dtype
        )
        # the servers' weights dtype when it is not the trainer's (rollout.dtype): the
        # checksum is of the weights rounded to it
        self.served_dtype = served_dtype
        self.restart_snapshot: tuple[Path, int] | None = None  # disk snapshot, its version
        self.newest: Snapshot | None = None  # newest publication (disk, broadcast or both)
        self._delivering = False  # a publication holds the lock (and repeats itself)
        self._task: asyncio.Task | None = None
        self.last_seconds = 0.0  # how long the last finished publication took
        self.count = 0
        self.total_seconds = 0.0
        supervisor.attach(self)

    @classmethod
    def for_run(
        cls,
        trainer: Trainer,
        listener: PublicationListener,
        supervisor: ServerSupervisor,
        publisher: WeightPublisher,
        root: Path,
        train: TrainConfig,
        served_dtype: str | None = None,
        *,
        clock: VersionClock | None = None,
    ) -> WeightSync:
        """A live run's: mode, deadlines, verification and canary from ``train``;
        ``served_dtype`` (``rollout.dtype`` when it is not the trainer's) or None; ``clock``:
        the run's, which ``listener`` (the controller) reads."""
        # servers in another dtype: their logprobs differ from the trainer's by the
        # rounding (bf16: ~0.1 nats, several on an odd prompt's first token), more than a
        # stale publication moves them, so no canary; the checksum of the rounded weights
        # still proves delivery exactly
        every = train.publish_canary_every if served_dtype is None else 0
        return cls(
            supervisor,
            publisher,
            root,
            listener,
            Canary(every, train.publish_canary_tolerance),
            trainer=trainer,
            mode=train.publish_mode,
            deadlines=Deadlines(train.publish_step_timeout_s, train.publish_timeout_s),
            verify=train.publish_verify,
            served_dtype=getattr(torch, served_dtype) if served_dtype else None,
            clock=clock,
        )

    # ------------------------------------------------------------------ the trainer side
    async def publish(self, wait: bool = False) -> float:
        """Publish the trainer's current version in the background (after the previous
        publication, so versions arrive in order); ``wait``: until the servers serve it.
        Returns the seconds the trainer was held: the snapshot, plus the previous
        publication if it is still loading."""
        trainer = self._the_trainer()
        return await self.submit(trainer, trainer.version, wait)

    async def maybe_publish(self, interval: int, last_step: bool) -> float:
        """:meth:`publish` when the servers lag the trainer by ``interval`` versions or more
        (not after the last step: the run is over); the seconds the trainer was held."""
        if last_step or self.clock.lag < interval:
            return 0.0
        return await self.publish()

    async def submit(self, source: WeightSource, version: int, wait: bool = False) -> float:
        """Snapshot ``source``'s weights as ``version`` and publish them in the background
        (after the previous publication: versions arrive in order); ``wait``: until the
        servers serve it. Returns the seconds ``source`` was held (the snapshot, plus the
        previous publication if it was still loading)."""
        start = time.perf_counter()
        await self.finish()
        snapshot, reference = await asyncio.to_thread(self._snapshot, source, version)
        self._task = asyncio.create_task(
            self._publish(snapshot, reference), name=f"publish-v{version}"
        )
        if wait:
            await self.finish()
        return time.perf_counter() - start

    async def servers_to_trainer(self) -> None:
        """Wait for the publication in flight, then publish the trainer's weights and wait
        for them if the servers still lag it (e.g. between two ``train.publish_every``
        publications, or after the last step, which publishes nothing)."""
        await self.finish()
        if self.clock.lag > 0:
            await self.publish(wait=True)
        if self.listener is not None and self.listener.failure is not None:
            raise self.listener.failure  # the publication failed, or a stop/fatal
        await self._restart_source_at_trainer()

    async def finish(self, timeout: float | None = None) -> None:
        """Wait for the publication in flight, if any (its error already reached the
        listener); at most ``timeout`` seconds (the publication bounds itself anyway: its
        deadlines). One still running past ``timeout`` is cancelled and left behind."""
        task, self._task = self._task, None
        if task is None:
            return
        await asyncio.wait({task}, timeout=timeout)
        if task.done():
            if self.listener is None and not task.cancelled() and task.exception():
                raise task.exception()  # nobody else heard of it
            abandon(task)  # its outcome was read
            return
        abandon(task)
        print(
            f"warning: publication {task.get_name()} did not end within {timeout:g}s; left behind",
            file=sys.stderr,
            flush=True,
        )

    async def cancel(self, timeout: float = EXIT_PUBLICATION_WAIT_S) -> None:
        """The run is ending: cancel the publication in flight (it resumes what it paused,
        under its step deadline) and wait for it at most ``timeout`` seconds."""
        if self._task is not None:
            self._task.cancel()
        await self.finish(timeout)

    def close(self) -> None:
        """Close the transport (its group); the weights directory is the run's to remove
        once the servers are stopped."""
        self.publisher.close()

    def _the_trainer(self) -> Trainer:
        if self.trainer is None:
            raise RelayError("this WeightSync has no trainer to publish: use submit()")
        return self.trainer

    def _snapshot(
        self, source: WeightSource, version: int
    ) -> tuple[Snapshot, torch.nn.Module | None]:
        """The publisher's snapshot with its checksum, and a copy of the trainer's model when
        this publication runs the canary (the trainer trains on meanwhile)."""
        snapshot = self.publisher.snapshot(source, self.root, version)
        if self.transaction.verify:
            snapshot.checksum = snapshot_checksum(snapshot, self.served_dtype)
        return snapshot, self.canary.reference(source, self.count)

    async def _publish(self, snapshot: Snapshot, reference: torch.nn.Module | None) -> None:
        start, version = time.perf_counter(), snapshot.version
        try:
            await self.deliver(snapshot)
            if reference is not None:
                await self.canary.run(version, reference)
        except Exception as exc:  # the trainer learns of it from its next batch
            if self.listener is not None:
                self.listener.fail(exc)
            raise
        self.clock.advance(version)
        if self.listener is not None:
            self.listener.set_published_version(self.clock.published)
        self.last_seconds = time.perf_counter() - start
        self.count += 1
        self.total_seconds += self.last_seconds
        if self.restart_snapshot is not None:  # keep the newest disk snapshot (restarts)
            remove_older_snapshots(self.root, self.restart_snapshot[1])

    async def _restart_source_at_trainer(self) -> None:
        """Make a server restarted during an evaluation load the evaluated version: when
        the newest disk snapshot is older (a broadcast-only publication), write the
        trainer's weights to disk as the restart source. Otherwise the replacement would
        load the older snapshot and be brought up by one more broadcast, and an evaluation
        request reaching it in between would carry tokens of the older version."""
        trainer = self._the_trainer()
        version, latest = trainer.version, self.restart_snapshot
        if (latest is None and version == 0) or (latest is not None and latest[1] >= version):
            return  # servers restart from the model directory (v0) or from this version
        path = await asyncio.to_thread(trainer.save_weights, self.root / f"v{version}")
        async with self.supervisor.lock:  # a restart in progress first finishes with the old
            if self.restart_snapshot is None or self.restart_snapshot[1] < version:
                self.restart_snapshot = (Path(path), version)

    # ------------------------------------------------------------------ the servers side
    async def deliver(self, snapshot: Snapshot) -> None:
        """Put ``snapshot`` on every server as one transaction, under the supervisor's lock:
        its ``path`` is the disk snapshot (None: broadcast only), its ``state`` the weights
        to broadcast (None: disk only), its ``checksum`` what every server must report
        having loaded. A server found unreachable on the way is restarted (loading the
        restart source) and the transaction repeated; so is one the failed attempt could
        not resume; other errors propagate (a PublicationError names the server, the step
        and the version)."""
        client = self.supervisor.client
        async with self.supervisor.lock:
            if snapshot.path is not None:
                self.restart_snapshot = (snapshot.path, snapshot.version)
            self.newest = snapshot
            self._delivering = True
            try:
                while True:
                    try:
                        await self.transaction.run(client, snapshot)
                        if snapshot.path is not None:  # e.g. written by a broadcast fallback
                            self.restart_snapshot = (snapshot.path, snapshot.version)
                        return
                    except RolloutServerError as exc:
                        if not exc.unreachable:
                            raise
                        what = "stopped answering during a publication"
                        await self.supervisor.restart_unreachable(exc.url, what)
                    except RelayError:
                        unresumed, self.transaction.unresumed = self.transaction.unresumed, []
                        why = "could not be resumed after a failed publication"
                        await self.supervisor.restart_servers(unresumed, why)
                        raise
            finally:
                self._delivering = False

    async def restart_source(self) -> tuple[Path, int] | None:
        """The snapshot a restarted server loads: the newest publication's. When it was
        broadcast only, its held weights are written to disk now
        (``WeightPublisher.restart_snapshot``), so a replacement starts at the newest
        version: one that started older would be routed requests before the catch-up
        broadcast reached it, and their tokens would carry that older version (staleness
        past η after a restart, AReaL#1388). Called by the supervisor under its lock."""
        newest, latest = self.newest, self.restart_snapshot
        if newest is not None and (latest is None or latest[1] < newest.version):
            path = await asyncio.to_thread(self.publisher.restart_snapshot, newest)
            if path is not None:
                self.restart_snapshot = (path, newest.version)
        return self.restart_snapshot

    async def server_replaced(self, old: str, new: str) -> None:
        """Server ``old`` was restarted at ``new`` (it serves :meth:`restart_source`): it is
        not paused, the transport hears of it (the broadcast group re-forms), and outside a
        publication a broadcast-only newest publication is caught up."""
        self.transaction.watch.clear([old])
        self.publisher.server_replaced(old, new)
        await self._catch_up()

    async def _catch_up(self) -> None:
        """After a restart outside a publication: if the newest publication was broadcast
        only, the replacement holds an older disk snapshot; broadcast the newest weights to
        every server again (the others reload the same version)."""
        newest = self.newest
        if self._delivering or newest is None or newest.state is None:
            return
        if self.restart_snapshot is not None and self.restart_snapshot[1] >= newest.version:
            return
        await self.transaction.run(self.supervisor.client, newest)

    def paused_overdue(self) -> bool:
        """Whether a publication has kept a server paused for longer than its whole
        deadline (the supervisor's watchdog asks)."""
        return bool(self.transaction.watch.overdue(self.transaction.deadlines.total_s))

    async def resume_overdue(self) -> list[str]:
        """The watchdog's check of paused servers: a server a publication has kept paused
        for longer than its whole deadline is resumed and reported. Returns the URLs."""
        deadlines, client = self.transaction.deadlines, self.supervisor.client
        overdue = self.transaction.watch.overdue(deadlines.total_s)
        for url, (seconds, version, step) in overdue.items():
            self.transaction.watch.clear([url])
            if url not in self.supervisor.launcher.urls:
                continue
            print(
                f"watchdog: rollout server {url} was paused for {seconds:.0f}s by the "
                f"publication of v{version} ({step} step, deadline "
                f"train.publish_timeout_s={deadlines.total_s:g}); resuming it",
                file=sys.stderr,
                flush=True,
            )
            try:
                await asyncio.wait_for(client.continue_generation([url]), deadlines.step_s)
            except (RolloutServerError, OSError, asyncio.TimeoutError) as exc:
                print(f"watchdog: resuming {url} failed ({exc!r})", file=sys.stderr, flush=True)
        return list(overdue)

    # ------------------------------------------------------------------ figures
    @property
    def seconds(self) -> float:
        """How long the last finished publication took."""
        return self.last_seconds

    @property
    def canaries(self) -> int:
        return self.canary.runs

    @property
    def canary_max_diff(self) -> float:
        return self.canary.max_diff

    def summary(self) -> dict[str, float | str]:
        """The run's publication figures: count, mean latency, the transport's own, the
        canary's."""
        return {
            PUBLICATIONS: self.count,
            PUBLISH_LATENCY_MEAN_S: self.total_seconds / max(self.count, 1),
            WEIGHT_TRANSPORT: self.publisher.name,
            **self.publisher.stats(),
            **self.canary.stats(),
        }


__all__ = [
    "EXIT_PUBLICATION_WAIT_S",
    "PublicationListener",
    "WeightSync",
    "publish_interval",
]
