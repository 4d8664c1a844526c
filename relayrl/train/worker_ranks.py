"""The processes of trainer ranks 1..N−1 that rank 0 starts, and what each needs to join it.

Owns: :data:`WORKER_SNIPPET` (a worker's entry, ``relayrl.train.distributed.worker_main``,
named by string: this module imports neither it nor the Ray launcher),
:func:`resolve_backend`, :func:`rank_environment` and :class:`WorkerRanks` (local
subprocesses; ``relayrl.train.ray_ranks.RayWorkerRanks`` is the Ray counterpart). Used by
``relayrl.train.distributed`` (which chooses the launcher) and ``relayrl.train.ray_ranks``.

Imports: config, errors.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from relayrl.config.schema import RunConfig
from relayrl.errors import RelayError
from relayrl.plugins import plugin_environment

WORKER_SNIPPET = "from relayrl.train.distributed import worker_main; worker_main()"
PARENT_ENV = "RELAYRL_TRAINER_PARENT_PID"
BACKEND_ENV = "RELAYRL_TRAINER_BACKEND"
TIMEOUT_ENV = "RELAYRL_DIST_TIMEOUT_S"
# the rendezvous secret: the ranks' keys in rank 0's store live under a prefix derived from it
SECRET_ENV = "RELAYRL_RENDEZVOUS_SECRET"


def resolve_backend(config: RunConfig) -> str:
    """``train.backend``, with ``auto`` = nccl when the model is on CUDA, else gloo."""
    backend = config.train.backend
    if backend == "auto":
        return "nccl" if str(config.model.device).startswith("cuda") else "gloo"
    return backend


def rank_environment(
    config: RunConfig, rank: int, master_addr: str, port: int, secret: str
) -> dict[str, str]:
    """What worker rank ``rank`` needs to join rank 0 at ``master_addr:port`` with the
    rendezvous ``secret`` (in the environment, never on a command line; a subprocess or a
    Ray actor's child; ``PARENT_ENV`` is set by whoever starts it)."""
    return {
        SECRET_ENV: secret,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(config.train.world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": str(config.train.trainer_threads),
        BACKEND_ENV: resolve_backend(config),
        TIMEOUT_ENV: str(config.train.dist_timeout_s),
        **plugin_environment(),  # the user's plugins, imported by the rank at start
    }


class WorkerRanks:
    """The worker processes rank 0 started (none under torchrun, which owns them), as
    ``Popen``-like handles by rank; ``master_addr`` is where rank 0 listens for them."""

    master_addr = "127.0.0.1"

    def __init__(self, procs: dict[int, Any], logs: dict[int, Path], run_dir: Path) -> None:
        self.procs, self.logs, self.run_dir = procs, logs, run_dir

    @classmethod
    def spawn(cls, config: RunConfig, port: int, log_dir: Path, secret: str) -> WorkerRanks:
        procs, logs = {}, {}
        for rank in range(1, config.train.world_size):
            env = {
                **os.environ,
                **rank_environment(config, rank, cls.master_addr, port, secret),
                PARENT_ENV: str(os.getpid()),
            }
            logs[rank] = log_dir / f"trainer-rank{rank}.log"
            with open(logs[rank], "w") as log:
                procs[rank] = subprocess.Popen(
                    [sys.executable, "-c", WORKER_SNIPPET],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
        return cls(procs, logs, log_dir)

    def where(self, rank: int) -> str:
        """Rank ``rank``'s process, for messages."""
        return f"pid {self.procs[rank].pid}"

    def dead(self) -> list[tuple[int, int]]:
        """``(rank, returncode)`` of every worker that has exited."""
        return [(r, p.returncode) for r, p in self.procs.items() if p.poll() is not None]

    def failure(self, grace_s: float = 2.0) -> RelayError | None:
        """A RelayError naming a dead rank (waiting up to ``grace_s`` for one to show)."""
        deadline = time.monotonic() + grace_s
        while not self.dead() and time.monotonic() < deadline and self.procs:
            time.sleep(0.05)
        for rank, code in self.dead():
            how = f"exit status {code}"
            if code < 0:
                how = f"killed by {signal.Signals(-code).name}"
            return RelayError(
                f"trainer rank {rank} ({self.where(rank)}) died ({how}); the job "
                f"stops: every rank takes part in each step (its log: {self.logs[rank]}). "
                f"Continue from the last checkpoint with `relayrl train --resume {self.run_dir}`"
            )
        return None

    def stop(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
