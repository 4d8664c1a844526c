"""Name → implementation tables behind the extension seams (losses, advantage estimators,
tasks, graders, workflows, rollout backends, weight transports, launchers, metric loggers):
one lookup with a helpful error, one registration rule.

Owns: :class:`Registry`, :func:`load_path`, and the registries whose implementations live
above the config layer, :data:`ROLLOUT_BACKENDS` (``rollout.engine``, filled by
``relayrl.launch.backends``), :data:`WEIGHT_TRANSPORTS` (``train.weight_transport``,
``relayrl.sync.transports``), :data:`LAUNCHERS` (``launcher``, ``relayrl.launch.launchers``;
its default :data:`DEFAULT_LAUNCHER`) and :data:`LOGGERS` (``train.loggers``,
``relayrl.train.loggers``). The
config validates names against them without importing those layers: their built-in entries
are named here by import path (``"module:Class"``) and loaded on first lookup; a plugin's
class, registered before the config is loaded, is found like a built-in one.

Imports: the standard library only (every layer may use it).
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class _Path(str):
    """An entry registered by import path, ``"package.module:Name"``, loaded on lookup."""

    def load(self) -> Any:
        return load_path(self)


def load_path(path: str) -> Any:
    """The object at import ``path``, ``"package.module:Name"`` (imported now)."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


class Registry(dict[str, T], Generic[T]):
    """A ``dict`` of named implementations of one kind (``kind`` names it in errors)."""

    def __init__(self, kind: str, base: type | None = None) -> None:
        super().__init__()
        self.kind, self.base = kind, base

    def add(self, name: str, item: T) -> T:
        """Register ``item`` as ``name``; registering the same item again is a no-op, a
        different one under a taken name is an error."""
        if not name:
            raise ValueError(f"a {self.kind} needs a non-empty name")
        existing = self.get(name)
        if isinstance(existing, _Path) and existing == _path_of(item):
            existing = None  # the module named by path registers the item itself
        if existing is not None and existing is not item:
            raise ValueError(f"a {self.kind} named {name!r} is already registered ({existing!r})")
        self[name] = item
        return item

    def add_class(self, cls: Any, base: type | None = None) -> Any:
        """Register a subclass of ``base`` (default: the registry's) under its ``name``
        attribute (a class decorator). A registry below its base class's layer is made
        without one; its ``register_*`` decorator passes it."""
        base = base or self.base
        if base is not None and not (isinstance(cls, type) and issubclass(cls, base)):
            raise TypeError(f"a {self.kind} must subclass {base.__name__}, got {cls!r}")
        name = getattr(cls, "name", "")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{cls.__name__} needs a class attribute 'name'")
        return self.add(name, cls)

    def add_path(self, name: str, path: str) -> None:
        """Register the item at import ``path`` (``"package.module:Name"``) as ``name``
        without importing it: :meth:`lookup` imports it. That module registering the item
        itself replaces the path."""
        if ":" not in path:
            raise ValueError(f"a {self.kind} path is 'package.module:Name', got {path!r}")
        self.add(name, _Path(path))  # type: ignore[arg-type]

    def check(self, name: str) -> str:
        """``name`` if it is registered (nothing is imported); else the :meth:`lookup` error."""
        if name in self:
            return name
        close = difflib.get_close_matches(name, list(self), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown {self.kind} {name!r}{hint}; expected one of {sorted(self)}")

    def lookup(self, name: str) -> T:
        """The item called ``name``; a ``ValueError`` suggests a close name and lists all."""
        item = self[self.check(name)]
        if isinstance(item, _Path):
            item = item.load()  # its module registers it on import, replacing the path
            self[name] = item
        return item


def _path_of(item: Any) -> str:
    return f"{getattr(item, '__module__', '')}:{getattr(item, '__qualname__', '')}"


# ------------------------------------------------------------------ seams above the config layer
# rollout.engine: a relayrl.launch.backends.RolloutBackend subclass (``register_backend``)
ROLLOUT_BACKENDS: Registry[Any] = Registry("rollout backend")
ROLLOUT_BACKENDS.add_path("builtin", "relayrl.launch.backends:BuiltinBackend")
ROLLOUT_BACKENDS.add_path("vllm", "relayrl.launch.backends:VLLMBackend")

# train.weight_transport: a relayrl.sync.transports.WeightPublisher subclass (``register_transport``)
WEIGHT_TRANSPORTS: Registry[Any] = Registry("weight transport")
WEIGHT_TRANSPORTS.add_path("disk", "relayrl.sync.transports.disk:DiskPublisher")
WEIGHT_TRANSPORTS.add_path("broadcast", "relayrl.sync.transports.broadcast:BroadcastPublisher")

# launcher: a relayrl.launch.launchers.Launcher subclass (``register_launcher``); the default
# places everything on this node, the one launcher that also serves rollout.lag's emulation
DEFAULT_LAUNCHER = "local"
LAUNCHERS: Registry[Any] = Registry("launcher")
LAUNCHERS.add_path("local", "relayrl.launch.launchers:LocalLauncher")
LAUNCHERS.add_path("ray", "relayrl.launch.launchers:RayLauncher")

# train.loggers: a relayrl.train.loggers.MetricSink subclass (``register_logger``)
LOGGERS: Registry[Any] = Registry("metric logger")
LOGGERS.add_path("tensorboard", "relayrl.train.loggers:TensorBoardSink")
LOGGERS.add_path("wandb", "relayrl.train.loggers:WandbSink")
LOGGERS.add_path("mlflow", "relayrl.train.loggers:MlflowSink")
