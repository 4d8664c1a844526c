"""The live console dashboard of `relayrl train`.

On a terminal: two lines redrawn in place (tqdm) — a progress bar with step, elapsed time,
ETA and seconds per step, and a status line with reward, train pass rate, the latest
held-out pass@1, staleness, generation / training throughput and the rollout servers
per node (how many are up; the others unanswered, restarting or down). When stdout is not a
terminal (a log file, a pipe, CI): the same status as one plain line every
``train.log_every`` steps and at the last step, with elapsed time and ETA. ``train.progress:
false`` is quiet mode: nothing per step.

Owns: :class:`Dashboard`, :func:`status_line`. Imports: tqdm (lazily), the train section of
the config, the metric names and the standard library.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any, TextIO

from relayrl.config.schema import TrainConfig
from relayrl.metric_names import (
    ELAPSED_S,
    ETA,
    EVAL_PASS_AT_1,
    GEN_TOKENS_PER_S,
    PASS_RATE,
    REWARD_MEAN,
    SERVERS,
    STALENESS_MAX,
    STALENESS_MEAN,
    STEP,
    TRAIN_TOKENS_PER_S,
)

# (metric key, label, format): shown in this order when the step logged the key
FIELDS: list[tuple[str, str, str]] = [
    (REWARD_MEAN, "reward", "{:.3f}"),
    (PASS_RATE, "pass", "{:.2f}"),
    (EVAL_PASS_AT_1, "eval pass@1", "{:.2f}"),
    (STALENESS_MEAN, "stale", "{:.2f}"),
    (STALENESS_MAX, "max", "{:.0f}"),
    (ETA, "η", "{:.0f}"),  # the bound (rollout.eta=auto: the rule's choice after the step)
    (GEN_TOKENS_PER_S, "gen tok/s", "{:.0f}"),
    (TRAIN_TOKENS_PER_S, "train tok/s", "{:.0f}"),
    (SERVERS, "servers", "{}"),
]


SET_PASS_AT_1 = EVAL_PASS_AT_1 + "/"  # eval.datasets: eval_pass@1/<set> (relayrl.eval.sets)


def status_line(metrics: Mapping[str, Any]) -> str:
    """``reward 0.412 | pass 0.40 | ...`` for the keys ``metrics`` holds; each held-out set's
    pass@1 (``eval_pass@1/<set>``) follows the pooled one."""
    parts = []
    for key, label, fmt in FIELDS:
        if isinstance(metrics.get(key), (int, float, str)) and not isinstance(metrics[key], bool):
            parts.append(f"{label} {fmt.format(metrics[key])}")
        if key == EVAL_PASS_AT_1:
            parts.extend(
                f"{k[len(SET_PASS_AT_1) :]} {v:.2f}"
                for k, v in metrics.items()
                if k.startswith(SET_PASS_AT_1) and isinstance(v, (int, float))
            )
    return " | ".join(parts)


def clock(seconds: float) -> str:
    """``1h02m03s`` / ``2m03s`` / ``4.5s``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def is_terminal(stream: TextIO) -> bool:
    """A terminal a bar can be drawn on: a TTY whose width is not 0 (a pseudo-terminal
    without a size, as some CI runners allocate, gets plain lines)."""
    isatty = getattr(stream, "isatty", None)
    if not (isatty and isatty()):
        return False
    try:
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):  # no file descriptor: trust isatty()
        return True


class Dashboard:
    """Per-step console output of a training loop; call :meth:`update` with each step's
    metrics row (it needs ``step``; ``elapsed_s`` gives the ETA of plain lines) and
    :meth:`close` at the end."""

    def __init__(
        self,
        total_steps: int,
        enabled: bool = True,
        log_every: int = 10,
        stream: TextIO | None = None,
    ) -> None:
        self.total = total_steps
        self.enabled = enabled
        self.log_every = log_every
        self.stream = stream if stream is not None else sys.stdout
        self.live = enabled and is_terminal(self.stream)
        self.last_eval: float | None = None
        self.last_sets: dict[str, Any] = {}
        self._bar = self._status = None
        if self.live:
            from tqdm import tqdm

            common = {"file": self.stream, "dynamic_ncols": True, "leave": True}
            self._bar = tqdm(total=total_steps, desc="rl step", position=0, **common)
            self._status = tqdm(total=0, position=1, bar_format="{desc}", **common)

    @classmethod
    def from_config(cls, train: TrainConfig) -> Dashboard:
        return cls(train.total_steps, train.progress, train.log_every)

    def update(self, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        if isinstance(metrics.get(EVAL_PASS_AT_1), (int, float)):
            self.last_eval = float(metrics[EVAL_PASS_AT_1])
            self.last_sets = {k: v for k, v in metrics.items() if k.startswith(SET_PASS_AT_1)}
        shown = {**metrics, EVAL_PASS_AT_1: self.last_eval, **self.last_sets}
        step = int(metrics[STEP])
        if self._bar is not None and self._status is not None:
            self._status.set_description_str(status_line(shown), refresh=True)
            self._bar.update(step - self._bar.n)
        elif self.log_every and (step % self.log_every == 0 or step == self.total):
            print(self._plain_line(step, shown), file=self.stream, flush=True)

    def _plain_line(self, step: int, metrics: Mapping[str, Any]) -> str:
        line = f"step {step}/{self.total} | {status_line(metrics)}"
        elapsed = metrics.get(ELAPSED_S)
        if isinstance(elapsed, (int, float)) and step > 0:
            eta = elapsed / step * (self.total - step)
            line += f" | elapsed {clock(elapsed)} | eta {clock(eta)}"
        return line

    def close(self) -> None:
        for bar in (self._bar, self._status):
            if bar is not None:
                bar.close()
        self._bar = self._status = None
