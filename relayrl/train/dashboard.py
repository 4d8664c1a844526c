"""The live console dashboard of `relayrl train`.

On a terminal: two lines redrawn in place (tqdm) — a progress bar with step, elapsed time,
ETA and seconds per step, and a status line with reward, train pass rate, the latest
held-out pass@1, staleness, generation / training throughput and the rollout servers
per node (how many are up; the others unanswered, restarting or down). When stdout is not a
terminal (a log file, a pipe, CI): the same status as one plain line every
``train.log_every`` steps and at the last step, with elapsed time and ETA. ``train.progress:
false`` is quiet mode: nothing per step. The mismatch doctor's warning (fresh tokens'
engine-vs-trainer KL above the run's threshold, ``relayrl.report.doctor.mismatch_threshold``:
1e-3 in float32, 1e-2 where the run rounds to bf16 on purpose; staleness cannot explain it)
is printed once, at the first step that shows it, as the report shows it.

Owns: :class:`Dashboard`, :func:`status_line`, :func:`mismatch_warning`. Imports: tqdm
(lazily), the train section of the config, the metric names, the doctor's threshold and
causes, and the standard library.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any, TextIO

from relayrl.config.schema import RunConfig
from relayrl.metric_names import (
    ELAPSED_S,
    ETA,
    EVAL_PASS_AT_1,
    GEN_TOKENS_PER_S,
    MISMATCH_KL,
    MISMATCH_TOKENS,
    PASS_RATE,
    REWARD_MEAN,
    SERVERS,
    STALENESS_MAX,
    STALENESS_MEAN,
    STEP,
    TRAIN_TOKENS_PER_S,
)
from relayrl.report.doctor import CAUSES, MIN_TOKENS, MISMATCH_THRESHOLD, mismatch_threshold

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


def mismatch_warning(
    metrics: Mapping[str, Any], threshold: float = MISMATCH_THRESHOLD
) -> str | None:
    """The doctor's one-line warning when this step's fresh (staleness 0) tokens disagree
    between engine and trainer by more than ``threshold``, over enough tokens; else None."""
    kl, tokens = metrics.get(MISMATCH_KL + "0"), metrics.get(MISMATCH_TOKENS + "0")
    if not isinstance(kl, (int, float)) or not isinstance(tokens, (int, float)):
        return None
    if tokens < MIN_TOKENS or not kl > threshold:
        return None
    return (
        f"warning: step {metrics.get(STEP)}: the engine and the trainer disagree on fresh "
        f"tokens (k3 KL {kl:.2e} over {int(tokens)} tokens of staleness 0, above "
        f"{threshold:g}): staleness cannot explain it; likely causes: "
        + "; ".join(CAUSES)
        + " (docs/observability.md, the mismatch doctor)"
    )


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
        mismatch_threshold: float = MISMATCH_THRESHOLD,
    ) -> None:
        self.total = total_steps
        self.mismatch_threshold = mismatch_threshold
        self.enabled = enabled
        self.log_every = log_every
        self.stream = stream if stream is not None else sys.stdout
        self.live = enabled and is_terminal(self.stream)
        self.last_eval: float | None = None
        self.last_sets: dict[str, Any] = {}
        self.warned_mismatch = False  # the doctor's warning is printed once a run
        self._bar = self._status = None
        if self.live:
            from tqdm import tqdm

            common = {"file": self.stream, "dynamic_ncols": True, "leave": True}
            self._bar = tqdm(total=total_steps, desc="rl step", position=0, **common)
            self._status = tqdm(total=0, position=1, bar_format="{desc}", **common)

    @classmethod
    def for_run(cls, config: RunConfig, total_steps: int) -> Dashboard:
        """The dashboard of a run: ``train.progress`` and ``train.log_every``, and the
        mismatch threshold of the run's precision."""
        threshold = mismatch_threshold(config.model_dump(mode="json"))
        train = config.train
        return cls(total_steps, train.progress, train.log_every, mismatch_threshold=threshold)

    def update(self, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        if isinstance(metrics.get(EVAL_PASS_AT_1), (int, float)):
            self.last_eval = float(metrics[EVAL_PASS_AT_1])
            self.last_sets = {k: v for k, v in metrics.items() if k.startswith(SET_PASS_AT_1)}
        shown = {**metrics, EVAL_PASS_AT_1: self.last_eval, **self.last_sets}
        step = int(metrics[STEP])
        self._warn_mismatch(metrics)
        if self._bar is not None and self._status is not None:
            self._status.set_description_str(status_line(shown), refresh=True)
            self._bar.update(step - self._bar.n)
        elif self.log_every and (step % self.log_every == 0 or step == self.total):
            print(self._plain_line(step, shown), file=self.stream, flush=True)

    def _warn_mismatch(self, metrics: Mapping[str, Any]) -> None:
        if self.warned_mismatch:
            return
        warning = mismatch_warning(metrics, self.mismatch_threshold)
        if warning is None:
            return
        self.warned_mismatch = True
        if self._bar is not None:
            self._bar.write(warning, file=self.stream)  # above the bars, which are redrawn
        else:
            print(warning, file=sys.stderr, flush=True)

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
