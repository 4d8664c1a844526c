"""Train-only replay of a recorded run: ``relayrl train --replay-from RUN_DIR CONFIG``.

A run recorded with ``train.dump_trajectories: true`` holds every trained trajectory in full
in ``samples.jsonl`` (``Trajectory.to_dict``: token ids, behaviour logprobs, versions,
reward, advantage), one row per sample in training order. This module reads them back —
grouped by step, and by group within a step, in the order they were trained — and feeds
them, as a :class:`RecordedBatches` source, to the training loop live runs use
(:class:`~relayrl.train.loop.TrainingLoop`): no rollout server, no grading pool; the
recorded rewards and advantages are used as they are (the rollout controller computed them
over each batch; the trainer only consumes them). With the recorded config and starting
weights the updates are the recorded run's, bit for bit
(tests/train/test_replay.py); change ``algo.*`` or ``optim.*`` to compare objectives on
identical data.

Only complete steps are replayed: a step counts when ``metrics.jsonl`` has its row (a run
killed mid-step leaves a partial last step, which is dropped).

Owns: :class:`RecordedStep`, :func:`load_recorded_steps`, :class:`RecordedBatches`,
:func:`run_replay`.
Imports: config, errors, the run-log reader of relayrl.report, the Trajectory record,
models, tasks, the trainer, the run logger, the training loop and rl.py's TrainResult.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from relayrl.config.schema import RunConfig
from relayrl.errors import RelayError
from relayrl.metric_names import EVAL_PASS_AT_1
from relayrl.report.logs import numbered_jsonl, read_jsonl
from relayrl.rollout.trajectory import Trajectory
from relayrl.train.loggers import check_loggers
from relayrl.train.loop import TrainingLoop
from relayrl.train.metrics import RunLogger, drift_summary, realised_staleness
from relayrl.train.options import TrainerOptions
from relayrl.train.rl import TrainResult
from relayrl.train.trainer import RLTrainer

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
        worst = max(t.staleness(rec.step) for t in rec.trajectories)
        if worst > eta:
            raise RelayError(
                f"recorded step {rec.step + 1} trains a sample of staleness {worst}, above "
                f"rollout.eta={eta}: replay with rollout.eta={worst} or more (the recorded "
                "run's value)"
            )


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


class RecordedBatches:
    """A :class:`~relayrl.train.loop.BatchSource` over a recorded run's steps: nothing to
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


def _replay_loop(config: RunConfig, run_dir: Path, total_steps: int) -> TrainingLoop:
    """The trainer (as ``run_train`` builds it), logger and held-out problems of a replay.
    A replay has no rollout servers: it evaluates in this process whatever ``eval.backend``
    says (with the same seed, what the built-in servers' evaluation gives, docs/engine.md)."""
    from relayrl.models.loading import load_model, load_tokenizer
    from relayrl.tasks.registry import make_task

    model_dir = Path(str(config.model.path))
    tokenizer = load_tokenizer(model_dir)
    torch.manual_seed(config.seed)  # as run_train does before loading the model
    model = load_model(model_dir, config.model.device, config.model.dtype)
    trainer = RLTrainer(model, TrainerOptions.from_config(config), pad_id=tokenizer.pad_token_id)
    task = make_task(config.task.name, config.task.params)
    test = task.problems("test", config.eval.num_problems, config.task.seed)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    logger = RunLogger.from_config(run_dir, config, decode)
    periodic = test[: config.train.eval_problems]
    return TrainingLoop(config, trainer, tokenizer, logger, periodic, test, total_steps)


def run_replay(config: RunConfig, source: str | Path, progress: bool | None = None) -> TrainResult:
    """Train on the trajectories recorded in ``source``; see the module docstring.

    Replays ``min(train.total_steps, recorded steps)`` steps and writes its own run
    directory (``<output_dir>/<name>``, or ``<name>-replay`` when that is ``source``).
    """
    from relayrl.config.loader import prepare_run_dir

    source = Path(source)
    if progress is not None:
        config = config.model_copy(
            update={"train": config.train.model_copy(update={"progress": progress})}
        )
    steps = load_recorded_steps(source)[: config.train.total_steps]
    config = replay_config(config, source)
    check_staleness(steps, config.rollout.eta)
    check_loggers(config)
    for line in config_differences(config, source):
        print(f"replay differs from the recorded run: {line}", flush=True)
    torch.set_num_threads(config.train.trainer_threads)
    run_dir = prepare_run_dir(config)
    replay = _replay_loop(config, run_dir, len(steps))
    start = time.perf_counter()
    try:
        final = asyncio.run(replay.run(RecordedBatches(steps)))
    finally:
        replay.logger.close()
    seconds = time.perf_counter() - start
    if config.train.save_final:
        out = run_dir / "final_model"
        replay.trainer.model.save_pretrained(out)
        replay.tokenizer.save_pretrained(out)
    summary = {"replay_from": str(source), "steps": len(steps)}
    summary["final_pass@1"] = final[EVAL_PASS_AT_1] if final else None
    summary.update(realised_staleness(run_dir / "metrics.jsonl"))
    summary.update(drift_summary(run_dir / "metrics.jsonl"))
    (run_dir / "train_summary.json").write_text(json.dumps(summary, indent=2))
    return TrainResult(
        run_dir, len(steps), summary["final_pass@1"], replay.evals, seconds, summary, replay.reports
    )
