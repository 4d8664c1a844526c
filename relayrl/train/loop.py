"""The one training loop, fed by a batch source: live rollouts or a recorded run.

Owns: :class:`BatchSource` (what the loop needs from where batches come from),
:class:`TrainingLoop` (per step: batch → optimizer step in a worker thread → the source's
post-update work, e.g. weight publication → held-out evaluation on its cadence → the
metrics row and the dashboard → the step hook, e.g. a checkpoint; then the final
evaluation and its row) and the held-out evaluation helpers. ``relayrl train`` composes it
with the rollout controller and servers (``relayrl.train.rl``), ``relayrl train
--replay-from`` with a recorded run's batches (``relayrl.train.replay_dump``): both train
through exactly this code.

Imports: config, eval, tasks, the Trajectory record, the trainer, the run logger and the
dashboard.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from relayrl.config.schema import EvalConfig, RunConfig
from relayrl.rollout.trajectory import Trajectory
from relayrl.tasks.base import Problem
from relayrl.train.dashboard import Dashboard
from relayrl.train.metrics import RunLogger, batch_metrics
from relayrl.train.trainer import RLTrainer

Groups = list[list[Trajectory]]


class BatchSource(Protocol):
    """Where a run's batches come from, and what happens around each update."""

    async def next_batch(self) -> Groups:
        """The next training batch: B complete groups, advantages set."""

    async def after_update(self, trainer_version: int, last_step: bool) -> dict[str, Any]:
        """Called right after each optimizer step (e.g. publish the weights); returns
        metrics for the step's row."""

    def step_metrics(self, step_seconds: float) -> dict[str, Any]:
        """Metrics of the source over the step that just ended (throughput, restarts)."""

    async def final_metrics(self) -> dict[str, Any]:
        """Extra metrics for the final row (e.g. the servers' counters)."""


def evaluate_model(model, tokenizer, problems: list[Problem], cfg: EvalConfig, seed: int):
    """Held-out pass@1 of ``model`` with the built-in engine (in this process)."""
    from relayrl.engine.engine import Engine
    from relayrl.eval.evaluate import evaluate

    was_training = model.training
    engine = Engine(model, tokenizer)
    try:
        return evaluate(engine, tokenizer, problems, cfg, seed=seed)
    finally:
        model.train(was_training)


def eval_metrics(
    trainer: RLTrainer, tokenizer, problems: list[Problem], config: RunConfig
) -> dict[str, Any]:
    """The metrics row of one held-out evaluation of the trainer's current weights."""
    start = time.perf_counter()
    cfg = config.eval.model_copy(update={"num_problems": len(problems)})
    report = evaluate_model(trainer.model, tokenizer, problems, cfg, config.seed)
    return {
        "eval_pass@1": report.pass_at_1,
        "eval_version": trainer.version,
        "eval_problems": report.num_problems,
        "time_eval_s": time.perf_counter() - start,
    }


@dataclass
class TrainingLoop:
    """``total_steps`` optimizer steps on batches from a :class:`BatchSource`.

    ``on_step_end(steps_done)`` runs after each step's row is logged (the live job's
    checkpoint and stop check). ``steps_done`` and ``evals`` are readable when ``run``
    raises, so the caller can checkpoint what was done."""

    config: RunConfig
    trainer: RLTrainer
    tokenizer: Any
    logger: RunLogger
    test_periodic: list[Problem]
    test_final: list[Problem]
    total_steps: int
    on_step_end: Callable[[int], Awaitable[None]] | None = None
    steps_done: int = 0
    evals: list[dict[str, Any]] = field(default_factory=list)

    async def evaluate(self, problems: list[Problem]) -> dict[str, Any]:
        result = await asyncio.to_thread(
            eval_metrics, self.trainer, self.tokenizer, problems, self.config
        )
        self.evals.append(result)
        return result

    async def run(self, source: BatchSource, first_step: int = 0) -> dict[str, Any] | None:
        """Train from ``first_step``; returns the final evaluation (None for 0 steps)."""
        cfg = self.config.train
        dashboard = Dashboard(self.total_steps, cfg.progress, cfg.log_every)
        self.steps_done = first_step
        start = last = time.perf_counter()
        try:
            if cfg.eval_every and first_step == 0:
                step0 = await self.evaluate(self.test_periodic)
                self.logger.log_step({"step": 0, "version": 0, **step0})
            for step in range(first_step, self.total_steps):
                metrics = await self._one_step(step, source)
                now = time.perf_counter()
                metrics["step_time_s"], metrics["elapsed_s"] = now - last, now - start
                metrics.update(source.step_metrics(now - last))
                last = now
                self.logger.log_step(metrics)
                dashboard.update(metrics)
                self.steps_done = step + 1
                if self.on_step_end is not None:
                    await self.on_step_end(self.steps_done)
            if not self.total_steps:
                return None
            final = await self.evaluate(self.test_final)
            self.logger.log_step(
                {
                    "step": self.total_steps,
                    "version": self.trainer.version,
                    "final": True,
                    **final,
                    **await source.final_metrics(),
                }
            )
            return final
        finally:
            dashboard.close()

    async def _one_step(self, step: int, source: BatchSource) -> dict[str, Any]:
        t0 = time.perf_counter()
        groups = await source.next_batch()
        t_wait = time.perf_counter() - t0
        trajs = [t for g in groups for t in g]
        version = self.trainer.version
        stats = await asyncio.to_thread(self.trainer.train_step, groups)
        self.logger.log_samples(trajs, step, version)
        last_step = step == self.total_steps - 1
        after = await source.after_update(self.trainer.version, last_step)
        metrics: dict[str, Any] = {"step": step + 1, "version": self.trainer.version}
        metrics.update(batch_metrics(trajs))
        metrics.update(stats)
        train_time = stats["time_prox_s"] + stats["time_update_s"]
        metrics["train_tokens_per_s"] = stats["train_tokens"] / max(train_time, 1e-9)
        metrics["time_wait_s"] = t_wait
        metrics.update(after)
        eval_every = self.config.train.eval_every
        if eval_every and (step + 1) % eval_every == 0 and not last_step:
            metrics.update(await self.evaluate(self.test_periodic))
        return metrics
