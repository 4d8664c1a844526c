"""`relayrl train`: the asynchronous RL job (rollout servers + controller + trainer).

Owns: :func:`run_train` (the whole job), :class:`TrainResult`, the training loop coroutine
and weight publication. Process layout (docs/async.md): the rollout servers are ``relayrl
serve`` child processes (``relayrl.launch.servers``); this process runs the controller
(asyncio), the grading pool's feeder threads and the trainer, whose optimizer steps run in a
worker thread so the event loop keeps feeding the servers meanwhile.

Publication every ``train.publish_every`` steps (at least every η + 1 steps, else the
admission bound would starve the trainer): the trainer saves a safetensors snapshot
(``/dev/shm`` when present) and goes on training while the servers load it in the
background; the admission bound moves up once they have. ``train.publish_mode``: ``retract``
(load only; each server re-queues its running requests and prefills them again under the
new weights) or ``abort`` (``pause("abort")``, load, ``continue_generation()``; the client
resubmits the aborted requests with their partial output).

Reliability (docs/reliability.md): checkpoints every ``train.checkpoint_every`` steps and on
SIGINT/SIGTERM, ``resume=True`` continues from the newest good one
(``relayrl.train.resume``); dead or hung rollout servers are restarted with the latest
weights and their requests resubmitted (``relayrl.launch.supervisor``).

Imports: config, engine client, rewards pool, eval, tasks, models, rollout controller,
trainer, run logger and loggers, console dashboard, launcher and supervisor, checkpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from relayrl.config.schema import EvalConfig, RunConfig
from relayrl.engine.client import RolloutClient, RolloutServerError
from relayrl.errors import RelayError
from relayrl.launch.servers import ServerLauncher, ServerSpec
from relayrl.launch.supervisor import ServerSupervisor
from relayrl.rewards.pool import Grader
from relayrl.rollout.controller import ControllerOptions, PromptLoader, RolloutController
from relayrl.tasks.base import Problem
from relayrl.train.checkpoint import Checkpoint
from relayrl.train.dashboard import Dashboard
from relayrl.train.loggers import check_loggers
from relayrl.train.metrics import RunLogger, batch_metrics, realised_staleness
from relayrl.train.resume import (
    RunCheckpoints,
    StopRequested,
    StopSignal,
    begin_run,
    remove_orphaned_dirs,
)
from relayrl.train.trainer import RLTrainer

# engine counters summed over the servers into the final metrics row (``server_<name>``):
# how much prefill the weight updates cost (KV recomputed for retracted requests)
SERVER_COUNTERS = (
    "prefill_tokens",
    "prefill_padded_tokens",
    "retracted",
    "reprefill_tokens",
    "kept_kv",
)


async def server_counters(client: RolloutClient) -> dict[str, float]:
    """The servers' :data:`SERVER_COUNTERS`, summed; empty when a server does not report
    them (an external SGLang/vLLM server) or cannot be reached."""
    try:
        infos = await client.server_info()
    except (RolloutServerError, OSError):
        return {}
    if not all(isinstance(i, dict) and all(k in i for k in SERVER_COUNTERS) for i in infos):
        return {}
    return {f"server_{k}": float(sum(i[k] for i in infos)) for k in SERVER_COUNTERS}


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    final_pass_at_1: float | None
    evals: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    summary: dict[str, Any] = field(default_factory=dict)


def publish_interval(publish_every: int, eta: int) -> int:
    """Steps between publications: ``publish_every``, capped at η + 1 (no starvation)."""
    return max(1, min(publish_every, eta + 1))


def train_problems(config: RunConfig, task) -> list[Problem]:
    """The train prompts: ``rollout.dataset`` if set, else the task's train split."""
    if config.rollout.dataset:
        from relayrl.tasks.datasets import load_problems

        return load_problems(config.rollout.dataset, split="train")
    return task.problems("train", config.task.train_size, config.task.seed)


def weights_root(config: RunConfig, run_dir: Path) -> Path:
    """Where published weights go: ``train.weights_dir``, else tmpfs, else the run dir."""
    if config.train.weights_dir:
        base = Path(config.train.weights_dir)
    elif Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK):
        base = Path("/dev/shm")
    else:
        base = run_dir
    base.mkdir(parents=True, exist_ok=True)
    prefix = f"relayrl-{config.name}-weights-"
    remove_orphaned_dirs(base, prefix)  # left by a killed run (tmpfs is memory)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=base))


def resolve_model_dir(config: RunConfig, progress: bool, reuse_sft: bool = False) -> Path:
    """``model.path``, or the SFT warm start written to ``<run>/sft_model`` (reused when
    ``reuse_sft`` and the SFT job finished, i.e. wrote ``sft_summary.json`` after the model:
    a resumed run keeps its initial policy)."""
    if config.model.path:
        return Path(config.model.path)
    run_dir = Path(config.output_dir) / config.name
    if reuse_sft and (run_dir / "sft_summary.json").is_file():
        return run_dir / "sft_model"
    from relayrl.train.sft import run_sft

    base = run_sft(config, progress=progress)
    print(f"sft warm start: base_pass@1={base:.2f}", flush=True)
    return run_dir / "sft_model"


def evaluate_model(model, tokenizer, problems: list[Problem], cfg: EvalConfig, seed: int):
    """pass@1 of the trainer's current weights (one version) on an in-process engine."""
    from relayrl.engine.engine import Engine
    from relayrl.engine.types import EngineOptions
    from relayrl.eval.evaluate import evaluate

    context = model.config.max_position_embeddings
    options = EngineOptions(max_running_requests=cfg.batch_size, max_seq_len=context)
    try:
        with torch.no_grad(), Engine(model, tokenizer, options) as engine:
            return evaluate(engine, tokenizer, problems, cfg, seed=seed)
    finally:
        model.train()


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


class _Job:
    """Everything one run holds; ``loop()`` is the training coroutine."""

    def __init__(
        self,
        config: RunConfig,
        run_dir: Path,
        model_dir: Path,
        launcher,
        pool,
        resume_from: Checkpoint | None = None,
    ) -> None:
        from relayrl.models.loading import encode_prompt, load_model, load_tokenizer
        from relayrl.tasks.registry import make_task

        self.config, self.run_dir, self.launcher, self.pool = config, run_dir, launcher, pool
        self.task = make_task(config.task.name, config.task.params)
        self.tokenizer = load_tokenizer(model_dir)
        torch.manual_seed(config.seed)
        model = load_model(model_dir, config.model.device, config.model.dtype)
        self.trainer = RLTrainer(model, config, pad_id=self.tokenizer.pad_token_id)
        self.loader = PromptLoader(train_problems(config, self.task), seed=config.seed)
        test = self.task.problems("test", config.eval.num_problems, config.task.seed)
        self.test_final = test
        self.test_periodic = test[: config.train.eval_problems]
        self.encode = lambda p: encode_prompt(self.tokenizer, p.prompt)
        self.decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)
        self.logger = RunLogger.from_config(run_dir, config, self.decode, append=bool(resume_from))
        self.weights = weights_root(config, run_dir)
        self.evals: list[dict[str, Any]] = []
        self.resume_from = resume_from
        self.checkpoints = RunCheckpoints(
            run_dir,
            config.train.checkpoint_every,
            config.train.keep_checkpoints,
            self.trainer,
            self.tokenizer,
        )
        self.steps_done = 0
        self.supervisor: ServerSupervisor | None = None
        self._publication: asyncio.Task | None = None
        self.publish_seconds = 0.0  # how long the last finished publication took

    # ------------------------------------------------------------------ pieces
    async def _publish(self, controller: RolloutController, wait: bool = False) -> float:
        """Snapshot the trainer's weights and load them into the servers in the background
        (after the previous publication, so versions arrive in order); returns the seconds
        the trainer was held: the snapshot, plus the previous publication if it is still
        loading. The controller's admission bound moves up when the servers have loaded."""
        start = time.perf_counter()
        await self._finish_publication()
        version = self.trainer.version
        path = await asyncio.to_thread(self.trainer.save_weights, self.weights / f"v{version}")
        self._publication = asyncio.create_task(
            self._load_into_servers(path, version, controller), name=f"publish-v{version}"
        )
        if wait:
            await self._finish_publication()
        return time.perf_counter() - start

    async def _load_into_servers(
        self, path: Path, version: int, controller: RolloutController
    ) -> None:
        start = time.perf_counter()
        try:
            await self.supervisor.publish(path, version)
        except Exception as exc:  # the trainer learns of it from its next batch
            controller.fail(exc)
            raise
        controller.set_published_version(version)
        self.publish_seconds = time.perf_counter() - start
        for old in self.weights.glob("v*"):
            if old.name[1:].isdigit() and int(old.name[1:]) < version:
                shutil.rmtree(old, ignore_errors=True)

    async def _finish_publication(self) -> None:
        """Wait for the publication in flight, if any (its error already reached the
        controller, which raises it from ``next_batch``)."""
        task, self._publication = self._publication, None
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)

    async def _evaluate(self, problems: list[Problem]) -> dict[str, Any]:
        result = await asyncio.to_thread(
            eval_metrics, self.trainer, self.tokenizer, problems, self.config
        )
        self.evals.append(result)
        return result

    async def _resume(self, controller: RolloutController) -> int:
        """Restore the checkpoint being resumed (if any) and publish its weights to the
        servers; returns the number of steps already done."""
        self.checkpoints.register("controller", controller)
        if self.resume_from is None:
            return 0
        done = self.checkpoints.restore(self.resume_from)
        versions = (done, self.trainer.version, controller.consumed_version)
        assert len(set(versions)) == 1, f"checkpoint step, trainer, controller: {versions}"
        await self._publish(controller, wait=True)
        if controller.failure is not None:
            raise controller.failure
        ready, running = controller.restored_counts()
        print(
            f"resumed from {self.resume_from.path}: {ready} complete groups and {running} "
            "in-flight prompts restored",
            flush=True,
        )
        return done

    def _server_error(self, exc: BaseException) -> RelayError:
        time.sleep(0.5)  # let a dying server's exit status show
        try:
            self.launcher.check()
        except RelayError as named:
            return named
        return RelayError(f"generation failed: {exc}")

    # ------------------------------------------------------------------ the loop
    async def loop(self, urls: list[str]) -> TrainResult:
        cfg = self.config
        interval = publish_interval(cfg.train.publish_every, cfg.rollout.eta)
        client = RolloutClient(urls, timeout=3600.0)
        self.supervisor = ServerSupervisor(
            self.launcher,
            client,
            cfg.rollout.max_server_restarts,
            cfg.rollout.server_hang_timeout_s,
            cfg.train.publish_mode,
        )
        controller = RolloutController(
            self.loader,
            ControllerOptions.from_config(cfg),
            # one HTTP exchange per group (its n samples as one batched /generate)
            lambda ids, params, key: client.generate_many([ids] * len(params), params, key=key),
            lambda problem, texts: self.pool.score_batch([(problem, t) for t in texts]),
            self.encode,
            self.decode,
        )
        first = self.steps_done = await self._resume(controller)
        controller.start()
        stop = StopSignal(controller.fail)
        stop.install()
        watch = asyncio.create_task(self.supervisor.watch(controller.fail))
        dashboard = Dashboard.from_config(cfg)
        start = last = time.perf_counter()
        try:
            if cfg.train.eval_every and first == 0:
                self.logger.log_step(
                    {"step": 0, "version": 0, **await self._evaluate(self.test_periodic)}
                )
            for step in range(first, cfg.train.total_steps):
                metrics = await self._one_step(step, controller, interval)
                now = time.perf_counter()
                metrics["step_time_s"], metrics["elapsed_s"] = now - last, now - start
                gen_tokens = controller.take_generated_tokens()
                metrics["gen_tokens_per_s"] = gen_tokens / max(now - last, 1e-9)
                metrics.update(self.supervisor.stats())
                last = now
                self.logger.log_step(metrics)
                dashboard.update(metrics)
                self.steps_done = step + 1
                await self.checkpoints.after_step(self.steps_done, cfg.train.total_steps, stop)
            final = None
            if cfg.train.total_steps:
                final = await self._evaluate(self.test_final)
                self.logger.log_step(
                    {
                        "step": cfg.train.total_steps,
                        "version": self.trainer.version,
                        "final": True,
                        **final,
                        **await server_counters(client),
                    }
                )
        except StopRequested:
            await self.checkpoints.save_and_stop(self.steps_done)
            raise
        except (RolloutServerError, OSError) as exc:
            raise self._server_error(exc) from exc
        finally:
            stop.uninstall()
            watch.cancel()
            if self._publication is not None:
                self._publication.cancel()
            await self._finish_publication()
            await controller.stop()
            await client.close()
            dashboard.close()
        summary = {"controller": controller.stats(), "grading": self.pool.stats()}
        return TrainResult(
            self.run_dir,
            cfg.train.total_steps,
            final["eval_pass@1"] if final else None,
            self.evals,
            time.perf_counter() - start,
            summary,
        )

    async def _one_step(
        self, step: int, controller: RolloutController, interval: int
    ) -> dict[str, Any]:
        cfg = self.config
        t0 = time.perf_counter()
        try:
            groups = await controller.next_batch()
        except RolloutServerError as exc:
            raise self._server_error(exc) from exc
        t_wait = time.perf_counter() - t0
        batch = [g.trajectories for g in groups]
        trajs = [t for g in batch for t in g]
        version = self.trainer.version
        stats = await asyncio.to_thread(self.trainer.train_step, batch)
        self.logger.log_samples(trajs, step, version)
        t_sync = 0.0
        last_step = step == cfg.train.total_steps - 1
        if not last_step and self.trainer.version - controller.published_version >= interval:
            t_sync = await self._publish(controller)
        metrics: dict[str, Any] = {"step": step + 1, "version": self.trainer.version}
        metrics.update(batch_metrics(trajs))
        metrics.update(stats)
        train_time = stats["time_prox_s"] + stats["time_update_s"]
        metrics["train_tokens_per_s"] = stats["train_tokens"] / max(train_time, 1e-9)
        metrics["time_wait_s"], metrics["time_sync_s"] = t_wait, t_sync
        metrics["publish_latency_s"] = self.publish_seconds
        metrics.update(controller.stats())
        metrics.update({f"grading_{k}": v for k, v in self.pool.stats().items()})
        if cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0 and not last_step:
            metrics.update(await self._evaluate(self.test_periodic))
        return metrics

    def close(self) -> None:
        self.logger.close()
        shutil.rmtree(self.weights, ignore_errors=True)


def run_train(
    config: RunConfig,
    progress: bool | None = None,
    grader: Grader | None = None,
    resume: bool = False,
) -> TrainResult:
    """The `relayrl train` job; see the module docstring. Returns the final evaluation.

    ``grader(problem, completion) -> reward`` replaces the task's verifier for training
    rewards (a module-level function: it runs in spawned grading processes). ``resume``:
    continue the run in ``<output_dir>/<name>`` from its newest good checkpoint (see
    ``relayrl.train.resume.resume_config`` for loading that run's config).
    """
    from relayrl.rewards.pool import GradingPool
    from relayrl.train.sft import prepare_run_dir

    if progress is not None:
        config = config.model_copy(
            update={"train": config.train.model_copy(update={"progress": progress})}
        )
    torch.set_num_threads(config.runtime.threads)
    model_dir = resolve_model_dir(config, config.train.progress, reuse_sft=resume)
    torch.set_num_threads(config.train.trainer_threads)
    run_dir = prepare_run_dir(config)
    checkpoint = begin_run(run_dir, config, resume)
    if config.rollout.dataset:  # fail on a bad dataset before starting any process
        train_problems(config, None)
    check_loggers(config)  # and on a logger whose package is missing
    spec = ServerSpec(
        model_dir=str(model_dir),
        threads=config.rollout.server_threads,
        max_running_requests=config.rollout.max_running_requests,
        max_seq_len=config.model.max_context,
        device=config.model.device,
        dtype=config.model.dtype,
    )
    launcher = ServerLauncher(
        spec,
        config.rollout.num_servers,
        config.rollout.server_mode,
        log_dir=run_dir,
        startup_timeout_s=config.rollout.startup_timeout_s,
    )
    pool = GradingPool(
        config.rollout.reward_workers, config.rollout.reward_timeout_s, grader=grader
    )
    job = None
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(config.train.switch_interval_ms / 1000)
    try:
        urls = launcher.start()
        job = _Job(config, run_dir, model_dir, launcher, pool, checkpoint)
        result = asyncio.run(job.loop(urls))
    finally:
        sys.setswitchinterval(switch_interval)
        launcher.stop()
        pool.close()
        if job is not None:
            job.close()
    if config.train.save_final:
        out = run_dir / "final_model"
        job.trainer.model.save_pretrained(out)
        job.tokenizer.save_pretrained(out)
    result.summary["final_pass@1"] = result.final_pass_at_1
    result.summary.update(realised_staleness(run_dir / "metrics.jsonl"))
    with contextlib.suppress(OSError):
        (run_dir / "train_summary.json").write_text(json.dumps(result.summary, indent=2))
    return result
