"""The trainer side of weight publication in a live run: hand the trainer's weights to the
launch layer, in order, and tell the rollout controller when the servers have them.

This module is the one call site of the launch layer's publication (snapshot with the
``train.weight_transport`` publisher, then ``ServerSupervisor.publish``); the transaction
itself (loading, restarts, which snapshot a restarted server loads) is ``relayrl.launch``'s.

Owns: :class:`Publication`, :func:`publish_interval`, :func:`remove_older_snapshots` and
:func:`weights_root`. Imports: config, the launch layer's publisher and supervisor, the
rollout controller, the orphaned-directory sweep of relayrl.train.resume.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

from relayrl.config.schema import RunConfig
from relayrl.launch.publish import Snapshot, WeightPublisher
from relayrl.launch.supervisor import ServerSupervisor
from relayrl.metric_names import PUBLICATIONS, PUBLISH_LATENCY_MEAN_S, WEIGHT_TRANSPORT
from relayrl.rollout.controller import RolloutController
from relayrl.train.distributed import TrainerGroup
from relayrl.train.resume import remove_orphaned_dirs
from relayrl.train.trainer import RLTrainer


def publish_interval(publish_every: int, eta: int) -> int:
    """Steps between publications: ``publish_every``, capped at η + 1 (no starvation)."""
    return max(1, min(publish_every, eta + 1))


def remove_older_snapshots(root: Path, version: int) -> list[Path]:
    """Delete the published weight snapshots ``root/v<k>`` with ``k < version`` (the servers
    have loaded ``version``); nothing else under ``root`` is touched. Returns what went."""
    removed = []
    for old in root.glob("v*"):
        if old.is_dir() and old.name[1:].isdigit() and int(old.name[1:]) < version:
            shutil.rmtree(old, ignore_errors=True)
            removed.append(old)
    return sorted(removed)


def weights_root(config: RunConfig, run_dir: Path) -> Path:
    """Where published weights go: ``train.weights_dir``, else tmpfs, else the run dir. On
    a Ray cluster (``launcher: ray`` with an address) the servers may sit on other nodes,
    so node-local tmpfs is skipped for the run dir (which must be on a shared filesystem)."""
    remote = config.launcher == "ray" and config.ray.address != "local"
    if config.train.weights_dir:
        base = Path(config.train.weights_dir)
    elif not remote and Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK):
        base = Path("/dev/shm")
    else:
        base = run_dir
    base.mkdir(parents=True, exist_ok=True)
    prefix = f"relayrl-{config.name}-weights-"
    remove_orphaned_dirs(base, prefix)  # left by a killed run (tmpfs is memory)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=base))


class Publication:
    """Publications of the trainer's weights to a live run's servers, one at a time and in
    version order; the controller's admission bound moves up once the servers have loaded
    one."""

    def __init__(
        self,
        trainer: RLTrainer | TrainerGroup,
        controller: RolloutController,
        supervisor: ServerSupervisor,
        publisher: WeightPublisher,
        weights: Path,
    ) -> None:
        self.trainer, self.controller = trainer, controller
        self.supervisor, self.publisher, self.weights = supervisor, publisher, weights
        self._in_flight: asyncio.Task | None = None
        self.seconds = 0.0  # how long the last finished publication took
        self.count = 0
        self.total_s = 0.0

    async def publish(self, wait: bool = False) -> float:
        """Publish the trainer's current version in the background (after the previous
        publication, so versions arrive in order); returns the seconds the trainer was
        held: the snapshot, plus the previous publication if it is still loading."""
        start = time.perf_counter()
        await self.finish()
        self._in_flight = await self._publish(self.trainer.version)
        if wait:
            await self.finish()
        return time.perf_counter() - start

    async def _publish(self, version: int) -> asyncio.Task:
        """The hand-over to the launch layer: snapshot the weights of ``version`` (held
        trainer) and load them into the servers in a background task."""
        snapshot = await asyncio.to_thread(
            self.publisher.snapshot, self.trainer, self.weights, version
        )  # train.weight_transport: a disk snapshot, a CPU copy to broadcast, or both
        return asyncio.create_task(self._load(snapshot), name=f"publish-v{version}")

    async def _load(self, snapshot: Snapshot) -> None:
        start, version = time.perf_counter(), snapshot.version
        try:
            await self.supervisor.publish(snapshot.path, version, snapshot.state)
        except Exception as exc:  # the trainer learns of it from its next batch
            self.controller.fail(exc)
            raise
        self.controller.set_published_version(version)
        self.seconds = time.perf_counter() - start
        self.count += 1
        self.total_s += self.seconds
        if self.supervisor.latest is not None:  # keep the newest disk snapshot (restarts)
            remove_older_snapshots(self.weights, self.supervisor.latest[1])

    async def finish(self) -> None:
        """Wait for the publication in flight, if any (its error already reached the
        controller, which raises it from ``next_batch``)."""
        task, self._in_flight = self._in_flight, None
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)

    async def cancel(self) -> None:
        """Cancel the publication in flight and wait for it to end."""
        if self._in_flight is not None:
            self._in_flight.cancel()
        await self.finish()

    async def servers_to_trainer(self) -> None:
        """Wait for the publication in flight, then publish the trainer's weights and wait
        for them if the servers still lag it (e.g. between two ``train.publish_every``
        publications, or after the last step, which publishes nothing)."""
        await self.finish()
        if self.controller.published_version < self.trainer.version:
            await self.publish(wait=True)
        if self.controller.failure is not None:  # the publication failed, or a stop/fatal
            raise self.controller.failure
        await self._restart_source_at_trainer()

    async def _restart_source_at_trainer(self) -> None:
        """Make a server restarted during an evaluation load the evaluated version: when
        the newest disk snapshot is older (a broadcast-only publication), write the
        trainer's weights to disk as the restart source. Otherwise the replacement would
        load the older snapshot and be brought up by one more broadcast, and an evaluation
        request reaching it in between would carry tokens of the older version."""
        version, latest = self.trainer.version, self.supervisor.latest
        if (latest is None and version == 0) or (latest is not None and latest[1] >= version):
            return  # servers restart from the model directory (v0) or from this version
        path = await asyncio.to_thread(self.trainer.save_weights, self.weights / f"v{version}")
        await self.supervisor.set_restart_snapshot(path, version)

    def summary(self) -> dict[str, float | str]:
        """The run's publication figures: count, mean latency, the transport's own."""
        return {
            PUBLICATIONS: self.count,
            PUBLISH_LATENCY_MEAN_S: self.total_s / max(self.count, 1),
            WEIGHT_TRANSPORT: self.publisher.name,
            **self.publisher.stats(),
        }

    def close(self) -> None:
        """Close the transport (its group); the weights directory is the run's to remove
        once the servers are stopped."""
        self.publisher.close()
