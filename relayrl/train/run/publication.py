"""The trainer side of weight publication in a live run: hand the trainer's weights to the
launch layer, in order, and tell the rollout controller when the servers have them.

This module is the one call site of the launch layer's publication transaction
(``relayrl.launch.publication.Publication``: snapshot with the ``train.weight_transport``
publisher, then pause → load → verify → resume → canary on every server under deadlines,
through the supervisor); the transaction, restarts and which snapshot a restarted server
loads are ``relayrl.launch``'s. This side decides when to publish and brings the servers to
the trainer's version before an evaluation on them.

Owns: :class:`Publication`, :func:`publish_interval` and :func:`weights_root`. Imports:
config, the launch layer's publication and supervisor, the rollout controller, the
orphaned-directory sweep of relayrl.train.resume.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

import torch

from relayrl.config.schema import RunConfig, TrainConfig
from relayrl.launch.publication import Canary, remove_older_snapshots
from relayrl.launch.publication import Publication as Transaction
from relayrl.launch.publish import WeightPublisher
from relayrl.launch.supervisor import ServerSupervisor
from relayrl.metric_names import PUBLICATIONS, PUBLISH_LATENCY_MEAN_S, WEIGHT_TRANSPORT
from relayrl.rollout.controller import RolloutController
from relayrl.train.distributed import TrainerGroup
from relayrl.train.resume import remove_orphaned_dirs
from relayrl.train.trainer import RLTrainer

# how long the run, ending, waits for a cancelled publication to leave the servers resumed
EXIT_PUBLICATION_WAIT_S = 30.0

__all__ = [
    "EXIT_PUBLICATION_WAIT_S",
    "Publication",
    "publish_interval",
    "remove_older_snapshots",
    "weights_root",
]


def publish_interval(publish_every: int, eta: int) -> int:
    """Steps between publications: ``publish_every``, capped at η + 1 (no starvation)."""
    return max(1, min(publish_every, eta + 1))


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
    version order, through the launch layer's transaction; the controller's admission bound
    moves up once every server serves one."""

    def __init__(
        self,
        trainer: RLTrainer | TrainerGroup,
        controller: RolloutController,
        supervisor: ServerSupervisor,
        publisher: WeightPublisher,
        weights: Path,
        train: TrainConfig,
        served_dtype: str | None = None,
    ) -> None:
        self.trainer, self.controller = trainer, controller
        self.supervisor, self.publisher, self.weights = supervisor, publisher, weights
        # servers in another dtype (rollout.dtype): their logprobs differ from the trainer's
        # by the rounding (bf16: ~0.1 nats, several on an odd prompt's first token), more
        # than a stale publication moves them, so no canary; the checksum of the rounded
        # weights still proves delivery exactly
        every = train.publish_canary_every if served_dtype is None else 0
        canary = Canary(every, train.publish_canary_tolerance)
        dtype = getattr(torch, served_dtype) if served_dtype else None
        self.transaction = Transaction(
            supervisor, publisher, weights, controller, canary, served_dtype=dtype
        )

    @property
    def seconds(self) -> float:
        """How long the last finished publication took."""
        return self.transaction.last_seconds

    async def publish(self, wait: bool = False) -> float:
        """Publish the trainer's current version in the background (after the previous
        publication, so versions arrive in order); returns the seconds the trainer was
        held: the snapshot, plus the previous publication if it is still loading."""
        return await self.transaction.submit(self.trainer, self.trainer.version, wait)

    async def finish(self) -> None:
        """Wait for the publication in flight, if any (its error already reached the
        controller, which raises it from ``next_batch``; it bounds itself by its deadlines)."""
        await self.transaction.finish()

    async def cancel(self) -> None:
        """The run is ending: cancel the publication in flight (it resumes what it paused)
        and wait for it at most :data:`EXIT_PUBLICATION_WAIT_S` seconds."""
        await self.transaction.close(EXIT_PUBLICATION_WAIT_S)

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
        count = self.transaction.count
        return {
            PUBLICATIONS: count,
            PUBLISH_LATENCY_MEAN_S: self.transaction.total_seconds / max(count, 1),
            WEIGHT_TRANSPORT: self.publisher.name,
            **self.publisher.stats(),
            **self.transaction.stats(),
        }

    def close(self) -> None:
        """Close the transport (its group); the weights directory is the run's to remove
        once the servers are stopped."""
        self.publisher.close()
