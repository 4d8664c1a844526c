"""The launcher seam (``launcher``): where a run's rollout servers and trainer ranks
1..N−1 run.

Owns: :class:`Launcher`, :func:`register_launcher` (into ``relayrl.registry.LAUNCHERS``, the
names ``launcher`` accepts), :func:`make_launcher` and the built-ins :class:`LocalLauncher`
(child processes of this one) and :class:`RayLauncher` (Ray actors placed by placement
groups, docs/cluster.md). Everything that differs between launchers is a method here:

* :meth:`Launcher.server_launcher`: what starts, checks, kills, restarts and stops the
  servers of a backend's spec (``relayrl.launch.backends.RolloutBackend.launcher``);
* :attr:`Launcher.trainer_ranks`: the class that starts trainer ranks 1..N−1, its
  ``spawn(config, port, log_dir, secret)``; it lives in relayrl.train, a layer above, so it
  is named by import path (``"module:Class"``, loaded by ``relayrl.train.distributed``);
  :meth:`Launcher.ranks_here`: how many of the N ranks this node holds;
* :meth:`Launcher.check_environment`: what ``relayrl check`` checks of it;
* :meth:`Launcher.spans_nodes`: whether the servers may run on other nodes (published
  weights then cannot go through this node's tmpfs).

Another launcher (Slurm job steps, Kubernetes pods) is one more subclass and one registry
line (``@register_launcher``), docs/extending.md.

Imports: relayrl.config, relayrl.launch.servers (and .ray_cluster when Ray is used),
relayrl.registry, relayrl.errors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar

from relayrl.config.schema import RunConfig
from relayrl.errors import RelayError
from relayrl.launch.servers import ServerLauncher
from relayrl.registry import LAUNCHERS


class Launcher(ABC):
    """One way of placing a run's processes; see the module docstring."""

    name: ClassVar[str]
    # "module:Class" of the WorkerRanks (sub)class that starts trainer ranks 1..N−1
    trainer_ranks: ClassVar[str]

    def __init__(self, config: RunConfig) -> None:
        self.config = config

    @abstractmethod
    def server_launcher(self, spec: Any, log_dir: Path | None) -> ServerLauncher:
        """The launcher of ``rollout.num_servers`` servers running ``spec`` (logs under
        ``log_dir``)."""

    def server_settings(self, spec: Any, log_dir: Path | None) -> dict[str, Any]:
        """What every :class:`ServerLauncher` takes: ``spec`` and ``rollout.*``'s settings."""
        rollout = self.config.rollout
        return {
            "spec": spec,
            "num_servers": rollout.num_servers,
            "mode": rollout.server_mode,
            "log_dir": log_dir,
            "startup_timeout_s": rollout.startup_timeout_s,
        }

    @abstractmethod
    def ranks_here(self) -> int:
        """How many of the ``train.world_size`` trainer ranks run on this node."""

    def check_environment(self) -> str | None:
        """A line for ``relayrl check``, or None when there is nothing to check; raises
        RelayError saying what to install or set."""
        return None

    def spans_nodes(self) -> bool:
        """Whether the rollout servers may run on another node than the trainer."""
        return False


def register_launcher(cls: type[Launcher]) -> type[Launcher]:
    """Class decorator: make ``cls`` (a :class:`Launcher` with a ``name``) a choice of
    ``launcher``."""
    return LAUNCHERS.add_class(cls, Launcher)


@register_launcher
class LocalLauncher(Launcher):
    """Every server and trainer rank a child process of this one, on this node."""

    name = "local"
    trainer_ranks = "relayrl.train.worker_ranks:WorkerRanks"

    def server_launcher(self, spec: Any, log_dir: Path | None) -> ServerLauncher:
        return ServerLauncher(**self.server_settings(spec, log_dir))

    def ranks_here(self) -> int:
        return self.config.train.world_size


@register_launcher
class RayLauncher(Launcher):
    """Servers and trainer ranks 1..N−1 as Ray actors on ``ray.address``'s cluster (rank 0
    stays in this process)."""

    name = "ray"
    trainer_ranks = "relayrl.train.ray_ranks:RayWorkerRanks"

    def server_launcher(self, spec: Any, log_dir: Path | None) -> ServerLauncher:
        from relayrl.launch.ray_cluster import RayServerLauncher

        return RayServerLauncher(**self.server_settings(spec, log_dir), ray_config=self.config.ray)

    def ranks_here(self) -> int:
        return 1  # Ray places the others (or says it cannot)

    def check_environment(self) -> str:
        try:
            import ray
        except ImportError as exc:
            raise RelayError(
                f"launcher=ray but ray does not import ({exc}); pip install 'ray[default]' "
                "(docs/cluster.md) or set launcher=local"
            ) from exc
        return f"launcher=ray: ray {ray.__version__} imports"

    def spans_nodes(self) -> bool:
        return self.config.ray.address != "local"


def make_launcher(config: RunConfig) -> Launcher:
    """The launcher of ``launcher`` (a name the config has checked against the registry)."""
    return LAUNCHERS.lookup(config.launcher)(config)
