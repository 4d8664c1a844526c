"""Metric loggers besides ``metrics.jsonl``: TensorBoard, Weights & Biases, MLflow.

Owns: :class:`MetricSink` (the interface), one sink per backend, :func:`resolve_loggers`
(the ``train.loggers`` default) and :func:`open_sinks`. Every backend is imported lazily and
is offline-safe by default: TensorBoard writes event files under ``<run>/tb``; W&B runs in
offline mode (files under ``<run>/wandb``) unless ``train.wandb_mode`` or ``$WANDB_MODE``
says otherwise; MLflow writes a file store at ``<run>/mlruns`` unless
``train.mlflow_tracking_uri`` or ``$MLFLOW_TRACKING_URI`` names another.

Imports: the standard library, the config schema and errors; the backends lazily.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from relayrl.config.schema import RunConfig
from relayrl.errors import RelayError

EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


class MetricSink(Protocol):
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


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


def require(name: str) -> None:
    """Raise a RelayError naming the extra to install when backend ``name`` is missing."""
    if not installed(name):
        raise RelayError(
            f"train.loggers includes '{name}' but the {name} package is not installed: "
            f"pip install 'relayrl[{EXTRAS[name]}]' (or remove '{name}' from train.loggers)"
        )


class TensorBoardSink:
    """Scalars under ``<run>/tb``; the resolved config as a text summary."""

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


class WandbSink:
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


class MlflowSink:
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


SINKS = {"tensorboard": TensorBoardSink, "wandb": WandbSink, "mlflow": MlflowSink}


def check_loggers(config: RunConfig) -> list[str]:
    """The backends ``train.loggers`` resolves to; raises naming the extra of a missing one."""
    names = resolve_loggers(config.train.loggers)
    for name in names:
        require(name)
    return names


def open_sinks(run_dir: Path, config: RunConfig) -> list[MetricSink]:
    """The sinks ``train.loggers`` asks for; every package is checked before any opens."""
    return [SINKS[name](run_dir, config) for name in check_loggers(config)]
