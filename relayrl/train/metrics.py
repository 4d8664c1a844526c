"""Run logs of `relayrl train`: ``metrics.jsonl`` (one object per step), ``samples.jsonl``
(every trained trajectory: summary, text, optionally the whole trajectory), ``inspect.jsonl``
(per-token versions and logprobs of a few groups per step, for ``relayrl inspect``) and the metric
sinks of ``train.loggers`` (TensorBoard, W&B, MLflow).

Owns: :class:`RunLogger`, :func:`sample_record`, :func:`inspect_record`, :func:`batch_metrics` (reward, pass rate,
lengths, versions of a batch), :func:`realised_staleness` and :func:`drift_summary` (a run's
staleness and per-version drift from its log). Imports: the config schema, the Trajectory record, the
sinks of ``relayrl.train.loggers`` and the standard library.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from relayrl.config.schema import RunConfig
from relayrl.metric_names import (
    BEHAV_PROX_KL,
    COMPLETED_CORRECT,
    DRIFT_KL,
    FINAL,
    PASS_RATE,
    REWARD_MEAN,
    STALENESS_MAX,
    STALENESS_MEAN,
    STEP,
)
from relayrl.rollout.distill import teacher_kl_metrics
from relayrl.rollout.environment import episode_means
from relayrl.rollout.trajectory import Trajectory
from relayrl.train.loggers import MetricSink, open_sinks, scalars

PASS_THRESHOLD = 0.5  # a sample "passes" when its reward exceeds this (rewards are 0/1)


def batch_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Reward, pass rate and response-length statistics of one training batch."""
    n = max(len(trajs), 1)
    lengths = [len(t.completion_ids) for t in trajs]
    return {
        REWARD_MEAN: sum(t.reward for t in trajs) / n,
        PASS_RATE: sum(t.reward > PASS_THRESHOLD for t in trajs) / n,
        COMPLETED_CORRECT: sum(completed_correct(t) for t in trajs) / n,
        "response_len_mean": sum(lengths) / n,
        "response_len_max": float(max(lengths, default=0)),
        "truncated_frac": sum(t.finish_reason == "length" for t in trajs) / n,
        "interrupted_frac": sum(len(set(t.versions)) > 1 for t in trajs) / n,
        **episode_metrics(trajs),
        **teacher_kl_metrics(trajs),  # on-policy distillation only
    }


def completed_correct(t: Trajectory) -> bool:
    """Finished within the token budget (not truncated) and passed."""
    return t.finish_reason != "length" and t.reward > PASS_THRESHOLD


def episode_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """``episode_<counter>`` means over the batch's episodes (``episode_turns``,
    ``episode_tool_calls_rate``: the tool-call rate, ...); empty for single-turn batches."""
    means = episode_means([t.episode for t in trajs if t.episode])
    return {f"episode_{k}": v for k, v in means.items()}


def sample_record(
    t: Trajectory,
    step: int,
    version: int,
    decode: Callable[[list[int]], str] | None = None,
    dump: bool = False,
) -> dict[str, Any]:
    """One ``samples.jsonl`` row: the summary, the text when ``decode`` is given and, with
    ``dump``, the whole trajectory (``Trajectory.to_dict``) for ``--replay-from``."""
    record: dict[str, Any] = {
        "step": step,
        "trainer_version": version,
        "prompt_id": t.prompt_id,
        "group_id": t.group_id,
        "sample_index": t.sample_index,
        "version_min": t.oldest_version,
        "version_max": t.newest_version,
        "reward": t.reward,
        "reward_status": t.reward_status,
        "advantage": t.advantage,
        "finish_reason": t.finish_reason,
        "completion_tokens": len(t.completion_ids),
    }
    if decode is not None:
        record["prompt_text"] = decode(t.prompt_ids)
        record["text"] = decode(t.completion_ids)
    if dump:
        record["trajectory"] = t.to_dict()
    return record


def run_lengths(values: Sequence[int]) -> list[list[int]]:
    """``[[value, count], ...]``: the runs of equal consecutive values (a sample's token
    versions are one or two runs)."""
    runs: list[list[int]] = []
    for v in values:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return runs


def inspect_record(
    t: Trajectory,
    step: int,
    version: int,
    prox: Sequence[float] | None,
    decode: Callable[[list[int]], str] | None,
) -> dict[str, Any]:
    """One ``inspect.jsonl`` row (``relayrl inspect``): a sample's tokens (decoded one by one
    when ``decode`` is given, else their ids), their versions as runs, and per token the
    behaviour logprob and the trainer's log π_v (``prox``; null when the step computed
    none), rounded to 4 decimals."""
    record: dict[str, Any] = {
        "step": step,
        "trainer_version": version,
        "group_id": t.group_id,
        "sample_index": t.sample_index,
        "versions": run_lengths(t.versions),
        "behav": [round(x, 4) for x in t.behav_logprobs],
        "prox": None if prox is None else [round(float(x), 4) for x in prox],
    }
    if decode is not None:
        record["pieces"] = [decode([i]) for i in t.completion_ids]
    else:
        record["ids"] = list(t.completion_ids)
    return record


# the per-version drift of every step (relayrl.algo.losses.policy_drift), summarised per run
DRIFT_KEYS = (DRIFT_KL, BEHAV_PROX_KL)


def _step_rows(metrics_path: Path) -> list[dict[str, Any]]:
    """The rows of a run's ``metrics.jsonl`` (empty when it does not exist)."""
    if not metrics_path.is_file():
        return []
    lines = metrics_path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def realised_staleness(metrics_path: Path) -> dict[str, float]:
    """``staleness_mean`` and ``staleness_max`` of a run's trained samples, from the
    per-step rows of its ``metrics.jsonl`` (every step of a resumed run included). Each step
    trains the same number of fresh samples (B complete groups of n), so the run's mean is
    the mean of the step means. Empty when no step was logged."""
    rows = [r for r in _step_rows(metrics_path) if STALENESS_MEAN in r]
    if not rows:
        return {}
    return {
        STALENESS_MEAN: sum(float(r[STALENESS_MEAN]) for r in rows) / len(rows),
        STALENESS_MAX: max(float(r[STALENESS_MAX]) for r in rows),
    }


def drift_summary(metrics_path: Path) -> dict[str, float]:
    """``<key>_mean`` and ``<key>_max`` over a run's steps for each of :data:`DRIFT_KEYS`
    (per-version drift and behaviour-vs-proximal KL), from its ``metrics.jsonl``; keys no
    step logged are left out."""
    rows = _step_rows(metrics_path)
    out: dict[str, float] = {}
    for key in DRIFT_KEYS:
        values = [float(r[key]) for r in rows if key in r and not r.get(FINAL)]
        if values:
            out[f"{key}_mean"] = sum(values) / len(values)
            out[f"{key}_max"] = max(values)
    return out


class RunLogger:
    """Appends to ``<run>/metrics.jsonl`` and ``<run>/samples.jsonl`` and forwards every
    step's scalars to the configured sinks (``relayrl.train.loggers``); close() at the end.

    ``decode(ids) -> text`` writes prompt and completion text into each sample row;
    ``dump`` writes the whole trajectory too. ``append``: continue existing files (a resumed
    run; see relayrl.train.resume).
    """

    def __init__(
        self,
        run_dir: Path,
        sinks: Sequence[MetricSink] = (),
        decode: Callable[[list[int]], str] | None = None,
        dump: bool = False,
        append: bool = False,
        inspect_groups: int = 0,
    ) -> None:
        self.metrics_path = run_dir / "metrics.jsonl"
        self.samples_path = run_dir / "samples.jsonl"
        self.sinks = list(sinks)
        self.decode, self.dump = decode, dump
        self.inspect_groups = inspect_groups
        mode = "a" if append else "w"
        self._metrics = open(self.metrics_path, mode)  # noqa: SIM115 - closed in close()
        self._samples = open(self.samples_path, mode)  # noqa: SIM115
        self._inspect = open(run_dir / "inspect.jsonl", mode) if inspect_groups > 0 else None  # noqa: SIM115

    @classmethod
    def from_config(
        cls,
        run_dir: Path,
        config: RunConfig,
        decode: Callable[[list[int]], str],
        append: bool = False,
    ) -> RunLogger:
        """The logger ``config.train`` asks for (sinks, text, trajectory dump)."""
        train = config.train
        text = decode if train.log_text or train.dump_trajectories else None
        sinks = open_sinks(run_dir, config)
        return cls(run_dir, sinks, text, train.dump_trajectories, append, train.inspect_groups)

    def log_step(self, metrics: dict[str, Any]) -> None:
        self._metrics.write(json.dumps(metrics) + "\n")
        self._metrics.flush()
        values = scalars(metrics)
        for sink in self.sinks:
            sink.log(values, int(metrics[STEP]))

    def log_samples(self, trajs: Sequence[Trajectory], step: int, version: int) -> None:
        for t in trajs:
            record = sample_record(t, step, version, self.decode, self.dump)
            self._samples.write(json.dumps(record) + "\n")
        self._samples.flush()

    def log_inspect(
        self,
        trained: Sequence[Trajectory],
        prox: Sequence[Any] | None,
        fresh: int,
        step: int,
        version: int,
    ) -> None:
        """``inspect.jsonl`` rows of one step: the tokens of the first ``inspect_groups``
        groups of the ``fresh`` samples that open ``trained``, and one row listing the
        samples D-ARL replayed (``trained[fresh:]``) at this step."""
        if self._inspect is None:
            return
        groups: list[str] = []
        for i, t in enumerate(trained[:fresh]):
            if t.group_id not in groups:
                if len(groups) == self.inspect_groups:
                    continue
                groups.append(t.group_id)
            values = None if prox is None else prox[i].detach().float().cpu().tolist()
            row = inspect_record(t, step, version, values, self.decode)
            self._inspect.write(json.dumps(row) + "\n")
        replayed = [[t.group_id, t.sample_index] for t in trained[fresh:]]
        if replayed:
            self._inspect.write(json.dumps({"step": step, "replayed": replayed}) + "\n")
        self._inspect.flush()

    def close(self) -> None:
        self._metrics.close()
        self._samples.close()
        if self._inspect is not None:
            self._inspect.close()
        for sink in self.sinks:
            sink.close()
