"""Metric loggers besides ``metrics.jsonl``: TensorBoard, Weights & Biases, MLflow.

Owns: :class:`MetricSink` (the base class), :func:`register_logger` (into
``relayrl.registry.LOGGERS``, the names ``train.loggers`` accepts), one sink per backend,
:func:`resolve_loggers` (the ``train.loggers`` default), :func:`check_loggers` and
:func:`open_sinks`. Another backend (a plugin's, docs/extending.md) is one subclass and one
registry line (``@register_logger``). Every backend is imported lazily and
is offline-safe by default: TensorBoard writes event files under ``<run>/tb``; W&B runs in
offline mode (files under ``<run>/wandb``) unless ``train.wandb_mode`` or ``$WANDB_MODE``
says otherwise; MLflow writes a file store at ``<run>/mlruns`` unless
``train.mlflow_tracking_uri`` or ``$MLFLOW_TRACKING_URI`` names another.

Imports: the standard library, the config schema, the registry and errors; the backends
lazily.
"""

from __future__ import annotations

import importlib.util
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from relayrl.config.schema import RunConfig
from relayrl.errors import RelayError
from relayrl.registry import LOGGERS


class MetricSink(ABC):
    """One metric logger of a run, opened as ``cls(run_dir, config)``: every step's numeric
    metrics go to :meth:`log`, :meth:`close` at the end. ``name`` is its ``train.loggers``
    entry; ``package``, when set, the module it imports, checked before any sink opens and
    installed by ``pip install '<install>'``."""

    name: ClassVar[str]
    package: ClassVar[str | None] = None
    install: ClassVar[str] = ""

    @abstractmethod
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


def register_logger(cls: type[MetricSink]) -> type[MetricSink]:
    """Class decorator: make ``cls`` (a :class:`MetricSink` with a ``name``) a choice of
    ``train.loggers``."""
    return LOGGERS.add_class(cls, MetricSink)


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numeric entries of a metrics row (booleans and the step itself left out)."""
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"
    }


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: a config as hyperparameters."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def resolve_loggers(configured: list[str] | None) -> list[str]:
    """``train.loggers``; null means TensorBoard when it is installed, else none."""
    if configured is None:
        return ["tensorboard"] if installed("tensorboard") else []
    return list(dict.fromkeys(configured))


def require(name: str) -> type[MetricSink]:
    """The logger registered as ``name``; a RelayError names what to install when its
    package is missing."""
    sink = LOGGERS.lookup(name)
    if sink.package is not None and not installed(sink.package):
        raise RelayError(
            f"train.loggers includes '{name}' but the {sink.package} package is not installed: "
            f"pip install '{sink.install or sink.package}' (or remove '{name}' from "
            "train.loggers)"
        )
    return sink


@register_logger
class TensorBoardSink(MetricSink):
    """Scalars under ``<run>/tb``; the resolved config as a text summary."""

    name = package = "tensorboard"
    install = "relayrl[tensorboard]"

    def __init__(self, run_dir: Path, config: RunConfig) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tb"))
        lines = [f"    {k}: {v}" for k, v in flatten(config.model_dump(mode="json")).items()]
        self.writer.add_text("config", "\n".join(lines), 0)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def wandb_mode(configured: str | None, environ: Mapping[str, str]) -> str | None:
    """The mode passed to ``wandb.init``: the config's, else None when ``$WANDB_MODE`` is set
    (W&B reads it), else offline."""
    if configured is not None:
        return configured
    return None if environ.get("WANDB_MODE") else "offline"


@register_logger
class WandbSink(MetricSink):
    """A W&B run, offline unless ``train.wandb_mode`` or ``$WANDB_MODE`` says otherwise."""

    name = package = "wandb"
    install = "relayrl[wandb]"

    def __init__(self, run_dir: Path, config: RunConfig) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=config.train.wandb_project,
            name=config.name,
            dir=str(run_dir),
            mode=wandb_mode(config.train.wandb_mode, os.environ),
            config=flatten(config.model_dump(mode="json")),
        )

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


def mlflow_uri(configured: str | None, environ: Mapping[str, str], run_dir: Path) -> str:
    """The config's tracking URI, else ``$MLFLOW_TRACKING_URI``, else ``<run>/mlruns``."""
    return (
        configured or environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").resolve().as_uri()
    )


def mlflow_key(key: str) -> str:
    """MLflow accepts letters, digits, ``_ - . / `` and spaces in metric names."""
    return re.sub(r"[^\w\-. /]", "_", key.replace("@", "_at_"))


@register_logger
class MlflowSink(MetricSink):
    """An MLflow run, in ``<run>/mlruns`` unless a tracking URI is configured."""

    name = package = "mlflow"
    install = "relayrl[mlflow]"

    def __init__(self, run_dir: Path, config: RunConfig) -> None:
        import mlflow

        self.mlflow = mlflow
        uri = mlflow_uri(config.train.mlflow_tracking_uri, os.environ, run_dir)
        if uri.startswith("file:"):  # MLflow >= 3.x refuses file stores unless opted in
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(config.train.mlflow_experiment)
        self.run = mlflow.start_run(run_name=config.name)
        params = flatten(config.model_dump(mode="json"))
        mlflow.log_params({k: str(v)[:500] for k, v in params.items()})

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.mlflow.log_metrics({mlflow_key(k): v for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def check_loggers(config: RunConfig) -> list[str]:
    """The backends ``train.loggers`` resolves to; raises naming the extra of a missing one."""
    names = resolve_loggers(config.train.loggers)
    for name in names:
        require(name)
    return names


def open_sinks(run_dir: Path, config: RunConfig) -> list[MetricSink]:
    """The sinks ``train.loggers`` asks for; every package is checked before any opens."""
    return [LOGGERS.lookup(name)(run_dir, config) for name in check_loggers(config)]
