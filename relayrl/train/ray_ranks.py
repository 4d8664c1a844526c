"""Trainer ranks 1..N−1 as Ray actors: ``launcher: ray`` with ``train.world_size`` N > 1.

Owns :class:`RayWorkerRanks`, the Ray counterpart of the local launcher's
:class:`~relayrl.train.worker_ranks.WorkerRanks` (same interface: ``procs``, ``logs``,
``dead``, ``failure``, ``stop``), so rank 0 (the driver, `relayrl train`) and the command
channel work unchanged; only *where* a rank runs differs:

* one placement group for the role "trainer ranks": a bundle of ``train.trainer_threads``
  CPUs (+ one GPU when ``model.device`` is CUDA) per rank ≥ 1, placed by
  ``ray.trainer_placement_strategy``; resources that never come give the server role's error
  (after ``ray.placement_timeout_s``, naming the role, the bundle and what the cluster has);
* rank ``r`` is an actor in bundle ``r − 1`` that runs the worker entry point of the local
  path (``relayrl.train.distributed.worker_main``) as its child, with the rendezvous
  environment pointing at rank 0's node address (``MASTER_ADDR``); the child dies with the
  actor (parent-death signal), and the actor with the driver (Ray kills an owner's actors);
* a dead actor reads as a rank killed by SIGKILL: rank 0's next collective fails and the
  run stops with the message naming the rank (and its node); ``--resume`` continues;
* ``<run>/cluster.json`` lists each rank's node, actor pid, pid and log under
  ``trainer_ranks`` (beside the servers); the logs go to the run directory, which on several
  nodes must be on a shared filesystem.

Imports: config, relayrl.launch.ray_cluster, relayrl.train.worker_ranks; ``ray``.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

from relayrl.config.schema import RunConfig
from relayrl.launch.ray_cluster import (
    RankHost,
    RemoteServer,
    await_start,
    connect,
    reserve,
    update_cluster_file,
)
from relayrl.train.worker_ranks import WORKER_SNIPPET, WorkerRanks, rank_environment

ROLE = "trainer ranks"


def rank_bundle(config: RunConfig) -> dict[str, float]:
    """The resources of one trainer rank ≥ 1: its threads, and a GPU on CUDA."""
    bundle = {"CPU": float(config.train.trainer_threads)}
    if str(config.model.device).startswith("cuda"):
        bundle["GPU"] = 1.0
    return bundle


class RayWorkerRanks(WorkerRanks):
    """Ranks 1..N−1 as Ray actors; see the module docstring."""

    def __init__(
        self, procs: dict[int, RemoteServer], logs: dict[int, Path], run_dir: Path, group: Any
    ) -> None:
        super().__init__(procs, logs, run_dir)
        self.group = group

    @classmethod
    def spawn(cls, config: RunConfig, port: int, log_dir: Path, secret: str) -> RayWorkerRanks:
        import ray

        connect(config.ray)
        ranks = cls({}, {}, log_dir, None)
        ranks.master_addr = ray.util.get_node_ip_address()  # where rank 0 (this process) is
        try:
            ranks.group = reserve(
                ROLE,
                [rank_bundle(config)] * (config.train.world_size - 1),
                config.ray.trainer_placement_strategy,
                config.ray.placement_timeout_s,
                "lower train.world_size / train.trainer_threads or add nodes",
            )
            for rank in range(1, config.train.world_size):
                ranks._start(config, rank, port, secret)
            ranks._write_cluster_file()
        except BaseException:
            ranks.stop(timeout_s=0)
            raise
        return ranks

    def _start(self, config: RunConfig, rank: int, port: int, secret: str) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = rank_bundle(config)
        actor = (
            ray.remote(max_restarts=0)(RankHost)
            .options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.group, placement_group_bundle_index=rank - 1
                ),
            )
            .remote()
        )
        env = rank_environment(config, rank, self.master_addr, port, secret)
        env["LOCAL_RANK"] = "0"  # Ray gives the actor its GPU as the only visible one
        log = self.run_dir / f"trainer-rank{rank}.log"
        ref = actor.start.remote([sys.executable, "-c", WORKER_SNIPPET], env, str(log))
        info = await_start(
            actor, ref, f"trainer rank {rank}", config.train.dist_timeout_s, "train.dist_timeout_s"
        )
        self.procs[rank], self.logs[rank] = RemoteServer(actor, info), log

    def where(self, rank: int) -> str:
        return f"pid {self.procs[rank].pid} on Ray node {self.procs[rank].info['node_ip']}"

    def stop(self, timeout_s: float = 10.0) -> None:
        """Reap the ranks (as the local path does), then end their actors and free the group."""
        import ray

        with contextlib.suppress(Exception):
            super().stop(timeout_s)
        for proc in self.procs.values():
            with contextlib.suppress(Exception):
                ray.kill(proc.actor, no_restart=True)
        if self.group is not None:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(self.group)
            self.group = None

    def _write_cluster_file(self) -> None:
        ranks = [{"rank": r, **p.info} for r, p in sorted(self.procs.items())]
        update_cluster_file(self.run_dir, trainer_ranks=ranks)
