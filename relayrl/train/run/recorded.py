"""A recorded run's batch source: ``relayrl train --replay-from RUN_DIR CONFIG``.

A run recorded with ``train.dump_trajectories: true`` holds every trained trajectory in full
in ``samples.jsonl`` (``Trajectory.to_dict``: token ids, behaviour logprobs, versions,
reward, advantage), one row per sample in training order. This module reads them back —
grouped by step, and by group within a step, in the order they were trained — and feeds
them, as a :class:`RecordedSource`, to the training loop live runs use, built by the same
:class:`~relayrl.train.run.setup.RunSetup`: no rollout server, no grading pool; the
recorded rewards and advantages are used as they are (the rollout controller computed them
over each batch; the trainer only consumes them). With the recorded config and starting
weights the updates are the recorded run's, bit for bit (tests/train/test_replay.py); change
``algo.*`` or ``optim.*`` to compare objectives on identical data.

Only complete steps are replayed: a step counts when ``metrics.jsonl`` has its row (a run
killed mid-step leaves a partial last step, which is dropped).

Owns: :class:`RecordedStep`, :func:`load_recorded_steps`, :class:`RecordedSource`,
:func:`run_replay`.
Imports: config, errors, the run-log reader of relayrl.report, the Trajectory record, the
staleness bound of relayrl.rollout, the loggers' check, the process settings and the run
package's setup.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relayrl.config.schema import RunConfig
from relayrl.errors import RelayError
from relayrl.models.loading import check_model_path
from relayrl.report.logs import numbered_jsonl, read_jsonl
from relayrl.rollout.trajectory import StalenessError, Trajectory
from relayrl.rollout.trajectory import check_staleness as check_bound
from relayrl.train.loggers import check_loggers
from relayrl.train.run.process import process_settings
from relayrl.train.run.setup import RunSetup, TrainResult, with_progress

NOT_DUMPED = (
    "has no 'trajectory' field: the run was recorded without train.dump_trajectories=true, "
    "so its token ids and behaviour logprobs are not there to replay"
)


@dataclass
class RecordedStep:
    """One recorded optimizer step: ``step`` is 0-based (the trainer version it started
    from); ``groups`` are lists of trajectories in training order."""

    step: int
    groups: list[list[Trajectory]]

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g]


def _trajectory(path: Path, number: int, row: dict[str, Any]) -> Trajectory:
    if "trajectory" not in row:
        raise RelayError(f"{path}:{number}: {NOT_DUMPED}")
    try:
        return Trajectory.from_dict(row["trajectory"])
    except (TypeError, ValueError) as exc:
        raise RelayError(f"{path}:{number}: not a valid trajectory record: {exc}") from exc


def completed_steps(run_dir: Path) -> set[int] | None:
    """0-based steps whose metrics row was written (None when there is no metrics.jsonl)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    return {int(row["step"]) - 1 for row in read_jsonl(path) if "step" in row}


def load_recorded_steps(run_dir: str | Path) -> list[RecordedStep]:
    """The complete recorded steps of ``run_dir``, from step 0 up to the first gap."""
    run = Path(run_dir)
    path = run / "samples.jsonl"
    if not path.is_file():
        raise RelayError(f"{path} does not exist: --replay-from needs a `relayrl train` run dir")
    by_step: dict[int, dict[str, list[Trajectory]]] = {}
    for number, row in numbered_jsonl(path):
        if not isinstance(row.get("step"), int):
            raise RelayError(f"{path}:{number}: no integer 'step' field")
        groups = by_step.setdefault(row["step"], {})
        groups.setdefault(row.get("group_id", ""), []).append(_trajectory(path, number, row))
    done = completed_steps(run)
    steps = []
    for step in range(len(by_step)):
        if step not in by_step or (done is not None and step not in done):
            break
        steps.append(RecordedStep(step, list(by_step[step].values())))
    if not steps:
        raise RelayError(f"{path} holds no complete training step to replay")
    return steps


def check_staleness(steps: list[RecordedStep], eta: int) -> None:
    """Every recorded sample must be within ``rollout.eta`` of the step that trains it."""
    for rec in steps:
        try:
            check_bound(rec.trajectories, rec.step, eta)
        except StalenessError as exc:
            raise RelayError(
                f"recorded step {rec.step + 1} trains a sample of staleness {exc.worst}, above "
                f"rollout.eta={eta}: replay with rollout.eta={exc.worst} or more (the recorded "
                "run's value)"
            ) from None


def replay_config(config: RunConfig, source: Path) -> RunConfig:
    """``config`` with a run directory other than ``source`` and the starting weights set:
    ``model.path``, else the recorded run's SFT warm start ``source/sft_model``."""
    train_dir = (Path(config.output_dir) / config.name).resolve()
    update: dict[str, Any] = {}
    if train_dir == source.resolve():
        update["name"] = f"{config.name}-replay"
    if not config.model.path:
        warm = source / "sft_model"
        if not warm.is_dir():
            raise RelayError(
                "replay needs the weights the recorded run started from: set model.path "
                f"(model.path is null and {warm} does not exist)"
            )
        update["model"] = config.model.model_copy(update={"path": str(warm)})
    return config.model_copy(update=update)


def config_differences(config: RunConfig, source: Path) -> list[str]:
    """``key: recorded -> now`` for the algo / optim keys that differ from the recorded run."""
    recorded_path = source / "config.yaml"
    if not recorded_path.is_file():
        return []
    from relayrl.config.loader import read_yaml

    recorded, _ = read_yaml(recorded_path)
    now = config.model_dump(mode="json")
    out = []
    for section in ("algo", "optim"):
        for key, value in now[section].items():
            before = recorded.get(section, {}).get(key, value)
            if before != value:
                out.append(f"{section}.{key}: {before} -> {value}")
    return out


class RecordedSource:
    """The :class:`~relayrl.train.loop.BatchSource` over a recorded run's steps: nothing to
    publish, no servers to count."""

    def __init__(self, steps: list[RecordedStep]) -> None:
        self._steps = iter(steps)

    async def next_batch(self) -> list[list[Trajectory]]:
        return next(self._steps).groups

    async def after_update(self, trainer_version: int, last_step: bool) -> dict[str, Any]:
        return {}

    def step_metrics(self, step_seconds: float) -> dict[str, Any]:
        return {}

    async def final_metrics(self) -> dict[str, Any]:
        return {}


def run_replay(
    config: RunConfig, source: str | Path, progress: bool | None = None, overwrite: bool = True
) -> TrainResult:
    """Train on the trajectories recorded in ``source``; see the module docstring.

    Replays ``min(train.total_steps, recorded steps)`` steps and writes its own run
    directory (``<output_dir>/<name>``, or ``<name>-replay`` when that is ``source``). A
    replay has no rollout servers: it evaluates in this process whatever ``eval.backend``
    says (with the same seed, what the built-in servers' evaluation gives, docs/engine.md).
    ``overwrite=False``: an earlier run in that directory is an error.
    """
    from relayrl.config.loader import claim_run_dir, prepare_run_dir, run_dir_of

    source = Path(source)
    config = with_progress(config, progress)
    steps = load_recorded_steps(source)[: config.train.total_steps]
    config = replay_config(config, source)
    check_staleness(steps, config.rollout.staleness.hard)
    check_loggers(config)
    check_model_path(config.model.path, config.model.system_prompt)
    claim_run_dir(run_dir_of(config), overwrite=overwrite)
    for line in config_differences(config, source):
        print(f"replay differs from the recorded run: {line}", flush=True)
    with process_settings(config):
        run_dir = prepare_run_dir(config)
        setup = RunSetup.build(
            config, run_dir, Path(str(config.model.path)), total_steps=len(steps)
        )
        start = time.perf_counter()
        try:
            final = asyncio.run(setup.training.run(RecordedSource(steps)))
        finally:
            setup.close()
        seconds = time.perf_counter() - start
    summary = {"replay_from": str(source), "steps": len(steps)}
    return setup.finish(setup.result(final, seconds, summary))
