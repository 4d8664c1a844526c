"""Run logs of `relayrl train`: ``metrics.jsonl`` (one object per step), ``samples.jsonl``
(every trained trajectory) and, optionally, TensorBoard scalars.

Owns: :class:`RunLogger`, :func:`batch_metrics` (reward, pass rate, lengths, versions of a
batch). Imports: the Trajectory record and the standard library (TensorBoard lazily).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relayrl.rollout.trajectory import Trajectory

PASS_THRESHOLD = 0.5  # a sample "passes" when its reward exceeds this (rewards are 0/1)


def batch_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Reward, pass rate and response-length statistics of one training batch."""
    n = max(len(trajs), 1)
    lengths = [len(t.completion_ids) for t in trajs]
    return {
        "reward_mean": sum(t.reward for t in trajs) / n,
        "pass_rate": sum(t.reward > PASS_THRESHOLD for t in trajs) / n,
        "response_len_mean": sum(lengths) / n,
        "response_len_max": float(max(lengths, default=0)),
        "truncated_frac": sum(t.finish_reason == "length" for t in trajs) / n,
        "interrupted_frac": sum(len(set(t.versions)) > 1 for t in trajs) / n,
    }


def sample_record(t: Trajectory, step: int, version: int, text: str | None) -> dict[str, Any]:
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
    if text is not None:
        record["text"] = text
    return record


class RunLogger:
    """Writes ``<run>/metrics.jsonl`` and ``<run>/samples.jsonl``; close() at the end.
    ``append``: continue existing files (a resumed run; see relayrl.train.resume)."""

    def __init__(self, run_dir: Path, tensorboard: bool = False, append: bool = False) -> None:
        self.metrics_path = run_dir / "metrics.jsonl"
        self.samples_path = run_dir / "samples.jsonl"
        mode = "a" if append else "w"
        self._metrics = open(self.metrics_path, mode)  # noqa: SIM115 - closed in close()
        self._samples = open(self.samples_path, mode)  # noqa: SIM115
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tb"))

    def log_step(self, metrics: dict[str, Any]) -> None:
        self._metrics.write(json.dumps(metrics) + "\n")
        self._metrics.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(key, value, metrics["step"])

    def log_samples(
        self,
        trajs: Sequence[Trajectory],
        step: int,
        version: int,
        texts: Sequence[str | None] | None = None,
    ) -> None:
        texts = texts if texts is not None else [None] * len(trajs)
        for t, text in zip(trajs, texts, strict=True):
            self._samples.write(json.dumps(sample_record(t, step, version, text)) + "\n")
        self._samples.flush()

    def close(self) -> None:
        self._metrics.close()
        self._samples.close()
        if self._tb is not None:
            self._tb.close()
