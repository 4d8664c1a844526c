"""Metric loggers: TensorBoard event files read back, offline-safe W&B / MLflow settings, a
clear error naming the extra when a backend is not installed."""

from __future__ import annotations

import sys

import pytest

from relayrl.config.loader import load_config
from relayrl.errors import RelayError
from relayrl.registry import LOGGERS
from relayrl.report.logs import read_jsonl
from relayrl.train.loggers import (
    MetricSink,
    check_loggers,
    installed,
    mlflow_key,
    mlflow_uri,
    resolve_loggers,
    wandb_mode,
)
from relayrl.train.run import run_train
from tests.train.conftest import rl_config


def test_tensorboard_event_file_holds_the_run_metrics(recorded_run):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(recorded_run / "tb"))
    events.Reload()
    rows = read_jsonl(recorded_run / "metrics.jsonl")
    for key in ("reward_mean", "staleness_mean", "grad_norm", "eval_pass@1"):
        want = [(r["step"], r[key]) for r in rows if key in r]
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert [s for s, _ in got] == [s for s, _ in want], key
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), key
    assert "final" not in events.Tags()["scalars"]  # booleans are not scalars


def test_default_loggers():
    assert resolve_loggers(None) == (["tensorboard"] if installed("tensorboard") else [])
    assert resolve_loggers([]) == []
    assert resolve_loggers(["mlflow", "tensorboard", "mlflow"]) == ["mlflow", "tensorboard"]


def test_wandb_and_mlflow_stay_offline_unless_configured(tmp_path):
    assert wandb_mode(None, {}) == "offline"
    assert wandb_mode(None, {"WANDB_MODE": "online"}) is None  # W&B reads the variable
    assert wandb_mode("online", {"WANDB_MODE": "offline"}) == "online"
    local = mlflow_uri(None, {}, tmp_path)
    assert local == (tmp_path / "mlruns").resolve().as_uri() and local.startswith("file:///")
    assert mlflow_uri(None, {"MLFLOW_TRACKING_URI": "http://h:5000"}, tmp_path) == "http://h:5000"
    assert mlflow_uri("sqlite:///x.db", {"MLFLOW_TRACKING_URI": "http://h"}, tmp_path) == (
        "sqlite:///x.db"
    )
    assert mlflow_key("eval_pass@1") == "eval_pass_at_1"


@pytest.mark.parametrize("backend", ["wandb", "mlflow"])
def test_missing_backend_names_the_extra_before_anything_starts(
    backend, tmp_path, tiny_model_dir, monkeypatch
):
    monkeypatch.setitem(sys.modules, backend, None)  # what Python does for a missing module
    assert not installed(backend)
    config = rl_config(tmp_path, tiny_model_dir, f"train.loggers=[{backend}]")
    with pytest.raises(RelayError, match=rf"pip install 'relayrl\[{backend}\]'"):
        check_loggers(config)
    with pytest.raises(RelayError, match=f"train.loggers includes '{backend}'"):
        run_train(config)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_logger_names_are_the_registered_ones(tmp_path, tiny_model_dir, monkeypatch):
    """A typo is refused at load with the nearest name; a registered logger whose package is
    missing names what to install (its own requirement, not a relayrl extra)."""
    with pytest.raises(RelayError, match=r"unknown metric logger 'mlfow' \(did you mean 'mlflow'"):
        load_config(None, ["train.loggers=[mlfow]"])

    class Needy(MetricSink):
        name, package, install = "needy", "needy_client", "needy-client>=1"

        def log(self, metrics, step): ...

        def close(self): ...

    monkeypatch.setitem(LOGGERS, "needy", Needy)
    config = rl_config(tmp_path, tiny_model_dir, "train.loggers=[needy]")
    with pytest.raises(
        RelayError, match="the needy_client package is not installed: pip install 'needy-client>=1'"
    ):
        check_loggers(config)


ROWS = [{"step": 1, "reward_mean": 0.25, "eval_pass@1": 0.5}, {"step": 2, "reward_mean": 0.75}]


def log_rows(run_dir, backend: str, monkeypatch) -> None:
    """ROWS through a RunLogger whose only sink is ``backend``, with no tracking variables."""
    from relayrl.config.loader import load_config
    from relayrl.train.metrics import RunLogger

    for var in ("WANDB_MODE", "MLFLOW_TRACKING_URI", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir.mkdir()
    config = load_config(None, [f"output_dir={run_dir.parent}", f"name={run_dir.name}"])
    logger = RunLogger(run_dir, [LOGGERS.lookup(backend)(run_dir, config)])
    for row in ROWS:
        logger.log_step(row)
    logger.close()


def test_mlflow_sink_writes_a_local_store(tmp_path, monkeypatch):
    """Runs where the mlflow extra is installed: metrics read back from <run>/mlruns."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    run = tmp_path / "run"
    log_rows(run, "mlflow", monkeypatch)
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    [logged] = client.search_runs([client.get_experiment_by_name("relayrl").experiment_id])
    history = client.get_metric_history(logged.info.run_id, "reward_mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.75)]
    assert [m.value for m in client.get_metric_history(logged.info.run_id, "eval_pass_at_1")] == [
        0.5
    ]
    assert logged.data.params["optim.lr"] == str(load_config(None).optim.lr)  # the default


def test_wandb_sink_runs_offline(tmp_path, monkeypatch):
    """Runs where the wandb extra is installed: an offline run directory, no network."""
    pytest.importorskip("wandb")
    run = tmp_path / "run"
    log_rows(run, "wandb", monkeypatch)
    [offline] = (run / "wandb").glob("offline-run-*")
    assert list(offline.glob("run-*.wandb"))


def test_every_step_row_carries_the_trainers_peak_memory(recorded_run):
    """An interrupted run writes no train_summary.json: each step's row says how much memory
    the trainer's process has held at most so far, never less than a row before it, and
    the summary's figure is at least the last row's."""
    import json

    steps = [r for r in read_jsonl(recorded_run / "metrics.jsonl") if "step_time_s" in r]
    peaks = [r["trainer_peak_rss_mb"] for r in steps]
    assert len(peaks) == 3 and peaks[0] > 50  # a torch process holds more than 50 MiB
    assert peaks == sorted(peaks)
    summary = json.loads((recorded_run / "train_summary.json").read_text())
    assert summary["trainer_peak_rss_mb"] >= peaks[-1]
