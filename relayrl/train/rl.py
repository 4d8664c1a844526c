"""`relayrl train`: the asynchronous RL job (rollout servers + controller + trainer).

Owns: :func:`run_train` (the whole job), :class:`TrainResult`, the live batch source (the
rollout controller's batches, weight publication after each update) that the shared
training loop (``relayrl.train.loop``) draws from. Process layout (docs/async.md): the rollout servers are ``relayrl
serve`` child processes (``relayrl.launch.servers``); this process runs the controller
(asyncio), the grading pool's feeder threads and the trainer, whose optimizer steps run in a
worker thread so the event loop keeps feeding the servers meanwhile. With
``train.world_size`` N > 1 the trainer is rank 0 of N data-parallel ranks
(``relayrl.train.distributed``), with the same interface.

Publication every ``train.publish_every`` steps (at least every η + 1 steps, else the
admission bound would starve the trainer): the trainer snapshots its weights
(``train.weight_transport``, ``relayrl.launch.publish``: a safetensors directory in
``/dev/shm`` when present, or a CPU copy broadcast to the servers over a gloo group) and goes
on training while the servers load it in the background; the admission bound moves up once
they have. ``train.publish_mode``: ``retract`` (load only; each server re-queues its running
requests and prefills them again under the new weights) or ``abort`` (``pause("abort")``,
load, ``continue_generation()``; the client resubmits the aborted requests with their
partial output).

Lag emulation (``rollout.lag`` fixed / uniform, docs/async.md): no rollout server; the job is
``relayrl.train.lag.LaggedJob``, which shares this job's setup and generates each batch in
this process with the weights v − d.

Reliability (docs/reliability.md): checkpoints every ``train.checkpoint_every`` steps and on
SIGINT/SIGTERM, ``resume=True`` continues from the newest good one
(``relayrl.train.resume``); dead or hung rollout servers are restarted with the latest
weights and their requests resubmitted (``relayrl.launch.supervisor``).

Imports: config, engine client, rewards pool, tasks, models, rollout controller and workflow,
trainer, training loop, run logger and loggers, launcher and supervisor, checkpoints.
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
from relayrl.eval.evaluate import EvalReport, WeightsChanged, evaluate
from relayrl.eval.remote import RemoteEngine
from relayrl.launch.backends import RolloutBackend, make_backend
from relayrl.launch.publish import Snapshot, make_publisher
from relayrl.launch.supervisor import ServerSupervisor
from relayrl.launch.teacher import teacher_launcher, with_teacher_url
from relayrl.metric_names import EVAL_PASS_AT_1, PUBLISH_LATENCY_S, SERVERS
from relayrl.rewards.pool import Grader
from relayrl.rollout.controller import ControllerOptions, RolloutController
from relayrl.rollout.distill import TeacherScorer
from relayrl.rollout.prompts import PromptLoader
from relayrl.rollout.trajectory import Trajectory
from relayrl.rollout.workflow import WORKFLOWS, GenerateFn, GenerateGroupFn
from relayrl.tasks.base import Problem
from relayrl.train.checkpoint import Checkpoint
from relayrl.train.distributed import TrainerGroup, check_trainer_ranks, make_trainer
from relayrl.train.loggers import check_loggers
from relayrl.train.loop import TrainingLoop
from relayrl.train.metrics import RunLogger, drift_summary, realised_staleness
from relayrl.train.resume import (
    RunCheckpoints,
    StopRequested,
    StopSignal,
    begin_run,
    remove_orphaned_dirs,
)

# the seconds an evaluation on the servers waited for the trainer's weights to be published
TIME_EVAL_PUBLISH_S = "time_eval_publish_s"

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
    eval_reports: list[EvalReport] = field(default_factory=list)  # in the order of evals


def teacher_scorer(config: RunConfig) -> TeacherScorer | None:
    """The rollout side's client of the distillation teacher (None when off); by now
    ``distill.teacher`` is a URL (a model directory was started by ``run_train``)."""
    url = config.distill.teacher
    if url is None:
        return None
    return TeacherScorer(url, config.rollout.temperature, config.rollout.startup_timeout_s * 5)


def publish_interval(publish_every: int, eta: int) -> int:
    """Steps between publications: ``publish_every``, capped at η + 1 (no starvation)."""
    return max(1, min(publish_every, eta + 1))


def remove_older_snapshots(root: Path, version: int) -> list[Path]:
    """Delete the published weight snapshots ``root/v<k>`` with ``k < version`` (the servers
    have loaded ``version``); nothing else under ``root`` is touched. Returns what went."""
    removed = []
    for old in root.glob("v*"):
        if old.is_dir() and old.name[1:].isdigit() and int(old.name[1:]) < version:
            shutil.rmtree(old, ignore_errors=True)
            removed.append(old)
    return sorted(removed)


def train_problems(config: RunConfig, task) -> list[Problem]:
    """The train prompts: ``rollout.dataset`` if set, else the task's train split."""
    if config.rollout.dataset:
        from relayrl.tasks.datasets import load_problems

        return load_problems(config.rollout.dataset, split="train")
    return task.problems("train", config.task.train_size, config.task.seed)


def weights_root(config: RunConfig, run_dir: Path) -> Path:
    """Where published weights go: ``train.weights_dir``, else tmpfs, else the run dir. On
    a Ray cluster (``launcher: ray`` with an address) the servers may sit on other nodes,
    so node-local tmpfs is skipped for the run dir (which must be on a shared filesystem)."""
    remote = config.launcher == "ray" and config.ray.address != "local"
    if config.train.weights_dir:
        base = Path(config.train.weights_dir)
    elif not remote and Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK):
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


class _Job:
    """Everything one live run holds, and the :class:`~relayrl.train.loop.BatchSource` the
    training loop draws from: batches from the rollout controller, weight publication after
    each update, the servers' counters; ``loop()`` starts the rollout side and runs the
    shared :class:`~relayrl.train.loop.TrainingLoop`."""

    def __init__(
        self,
        config: RunConfig,
        run_dir: Path,
        model_dir: Path,
        launcher,
        pool,
        resume_from: Checkpoint | None = None,
        backend: RolloutBackend | None = None,
    ) -> None:
        from relayrl.models.loading import encode_prompt, load_model, load_tokenizer
        from relayrl.tasks.registry import make_task

        self.config, self.run_dir, self.launcher, self.pool = config, run_dir, launcher, pool
        self.backend = backend or make_backend(config, model_dir)
        self.task = make_task(config.task.name, config.task.params)
        self.tokenizer = load_tokenizer(model_dir)
        torch.manual_seed(config.seed)
        model = load_model(model_dir, config.model.device, config.model.dtype)
        self.trainer = make_trainer(
            model, config, self.tokenizer.pad_token_id, model_dir, run_dir
        )  # world_size > 1: rank 0 of the data-parallel ranks (relayrl.train.distributed)
        self.loader = PromptLoader(train_problems(config, self.task), seed=config.seed)
        test = self.task.problems("test", config.eval.num_problems, config.task.seed)
        self.test_final = test
        self.test_periodic = test[: config.train.eval_problems]
        self.encode = lambda p: encode_prompt(self.tokenizer, p.prompt)
        self.decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)
        self.encode_text = lambda text: self.tokenizer(text, add_special_tokens=False)["input_ids"]
        self.logger = RunLogger.from_config(run_dir, config, self.decode, append=bool(resume_from))
        self.weights = weights_root(config, run_dir)
        self.resume_from = resume_from
        self.checkpoints = RunCheckpoints(
            run_dir,
            config.train.checkpoint_every,
            config.train.keep_checkpoints,
            self.trainer,
            self.tokenizer,
        )
        self.training = TrainingLoop(
            config,
            self.trainer,
            self.tokenizer,
            self.logger,
            self.test_periodic,
            self.test_final,
            config.train.total_steps,
        )
        self.supervisor: ServerSupervisor | None = None
        self._publication: asyncio.Task | None = None
        self.publish_seconds = 0.0  # how long the last finished publication took
        self.publications = 0
        self.publish_total_s = 0.0

    # ------------------------------------------------------------------ pieces
    def make_controller(
        self, generate_group: GenerateGroupFn, generate: GenerateFn
    ) -> RolloutController:
        """The run's rollout controller over these generate functions (a group's samples
        in one call; one request), grading in the pool."""
        return RolloutController(
            self.loader,
            ControllerOptions.from_config(self.config),
            generate_group,
            lambda problem, texts: self.pool.score_batch([(problem, t) for t in texts]),
            self.encode,
            self.decode,
            workflow=WORKFLOWS.lookup(self.config.rollout.workflow)(),
            generate=generate,
            encode_text=self.encode_text,
            teacher=teacher_scorer(self.config),
        )

    async def _publish(self, controller: RolloutController, wait: bool = False) -> float:
        """Snapshot the trainer's weights and load them into the servers in the background
        (after the previous publication, so versions arrive in order); returns the seconds
        the trainer was held: the snapshot, plus the previous publication if it is still
        loading. The controller's admission bound moves up when the servers have loaded."""
        start = time.perf_counter()
        await self._finish_publication()
        version = self.trainer.version
        snapshot = await asyncio.to_thread(
            self.publisher.snapshot, self.trainer, self.weights, version
        )  # train.weight_transport: a disk snapshot, a CPU copy to broadcast, or both
        self._publication = asyncio.create_task(
            self._load_into_servers(snapshot, controller), name=f"publish-v{version}"
        )
        if wait:
            await self._finish_publication()
        return time.perf_counter() - start

    async def _load_into_servers(self, snapshot: Snapshot, controller: RolloutController) -> None:
        start, version = time.perf_counter(), snapshot.version
        try:
            await self.supervisor.publish(snapshot.path, version, snapshot.state)
        except Exception as exc:  # the trainer learns of it from its next batch
            controller.fail(exc)
            raise
        controller.set_published_version(version)
        self.publish_seconds = time.perf_counter() - start
        self.publications += 1
        self.publish_total_s += self.publish_seconds
        if self.supervisor.latest is not None:  # keep the newest disk snapshot (restarts)
            remove_older_snapshots(self.weights, self.supervisor.latest[1])

    async def _finish_publication(self) -> None:
        """Wait for the publication in flight, if any (its error already reached the
        controller, which raises it from ``next_batch``)."""
        task, self._publication = self._publication, None
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)

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

    # ------------------------------------------------------------------ evaluation
    async def evaluate_on_servers(
        self, problems: list[Problem], cfg: EvalConfig, seed: int
    ) -> tuple[EvalReport, dict[str, Any]]:
        """``eval.backend=servers``: the held-out evaluation of the trainer's weights on the
        run's rollout servers, through the run's own client (round-robin over the servers,
        failover through the supervisor) while the controller keeps generating.

        The servers are first brought to the trainer's version (:meth:`_servers_to_trainer`).
        No publication lands while it runs: only the training loop starts publications
        (:meth:`after_update`) and the loop is here, awaiting this. The supervisor's lock is
        not held, so a server that fails meanwhile is restarted as always (with the newest
        disk snapshot, the trainer's version under the disk transport) and its requests are
        resubmitted there."""
        start = time.perf_counter()
        await self._servers_to_trainer()
        published = time.perf_counter() - start
        loop = asyncio.get_running_loop()

        def run() -> EvalReport:  # in a worker thread: the requests go to this loop
            with RemoteEngine.sharing(self.client, loop) as engine:
                return evaluate(engine, self.tokenizer, problems, cfg, seed=seed)

        try:
            report = await asyncio.to_thread(run)
        except WeightsChanged as exc:
            raise RelayError(f"eval.backend=servers: {exc}") from exc
        return report, {TIME_EVAL_PUBLISH_S: published}

    async def _servers_to_trainer(self) -> None:
        """Wait for the publication in flight, then publish the trainer's weights and wait
        for them if the servers still lag it (e.g. between two ``train.publish_every``
        publications, or after the last step, which publishes nothing)."""
        await self._finish_publication()
        if self.controller.published_version < self.trainer.version:
            await self._publish(self.controller, wait=True)
        if self.controller.failure is not None:  # the publication failed, or a stop/fatal
            raise self.controller.failure
        await self._restart_source_at_trainer()

    async def _restart_source_at_trainer(self) -> None:
        """Make a server restarted during the evaluation load the evaluated version: when
        the newest disk snapshot is older (a broadcast-only publication), write the
        trainer's weights to disk as the restart source. Otherwise the replacement would
        load the older snapshot and be brought up by one more broadcast, and an evaluation
        request reaching it in between would carry tokens of the older version."""
        version, latest = self.trainer.version, self.supervisor.latest
        if (latest is None and version == 0) or (latest is not None and latest[1] >= version):
            return  # servers restart from the model directory (v0) or from this version
        path = await asyncio.to_thread(self.trainer.save_weights, self.weights / f"v{version}")
        await self.supervisor.set_restart_snapshot(path, version)

    # ------------------------------------------------------------------ the loop
    async def loop(self, urls: list[str]) -> TrainResult:
        cfg = self.config
        self.interval = publish_interval(cfg.train.publish_every, cfg.rollout.eta)
        self.client = client = self.backend.client(urls, timeout=3600.0)
        self.publisher = make_publisher(
            cfg.train.weight_transport,
            cfg.train.broadcast_timeout_s,
            cfg.train.broadcast_snapshot_every,
        )
        try:
            await self.backend.check_servers(client)
        except RolloutServerError:
            pass  # unreachable: it died since it started; the supervisor restarts or names it
        except BaseException:
            await client.close()
            raise
        self.supervisor = ServerSupervisor(
            self.launcher,
            client,
            0 if cfg.rollout.server_urls else cfg.rollout.max_server_restarts,
            cfg.rollout.server_hang_timeout_s,
            cfg.train.publish_mode,
            self.publisher,
        )
        self.controller = controller = self.make_controller(
            # one HTTP exchange per group (its n samples as one batched /generate)
            lambda ids, params, key: client.generate_many([ids] * len(params), params, key=key),
            # later turns of multi-turn episodes: one request each, resubmitted after aborts
            lambda ids, params, key: client.generate(ids, params, key=key),
        )
        if cfg.eval.backend == "servers":
            self.training.evaluator = self.evaluate_on_servers
        first = await self._resume(controller)
        controller.start()
        stop = StopSignal(controller.fail)
        stop.install()
        watch = asyncio.create_task(self.supervisor.watch(controller.fail))
        self.training.on_step_end = lambda done: self.checkpoints.after_step(
            done, cfg.train.total_steps, stop
        )
        start = time.perf_counter()
        try:
            final = await self.training.run(self, first)
        except StopRequested:
            await self.checkpoints.save_and_stop(self.training.steps_done)
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
            self.publisher.close()
            await client.close()
        return self.result(
            final,
            time.perf_counter() - start,
            rollout_engine=cfg.rollout.engine,
            publications=self.publications,
            publish_latency_mean_s=self.publish_total_s / max(self.publications, 1),
            weight_transport=self.publisher.name,
            **self.publisher.stats(),
            **self.supervisor.stats(),  # the run's restarts, the final evaluation's included
        )

    def result(self, final: dict[str, Any] | None, seconds: float, **summary: Any) -> TrainResult:
        """The run's result: its final evaluation, the controller's and graders' counters
        and ``summary``."""
        return TrainResult(
            self.run_dir,
            self.config.train.total_steps,
            final[EVAL_PASS_AT_1] if final else None,
            self.training.evals,
            seconds,
            {"controller": self.controller.stats(), "grading": self.pool.stats(), **summary},
            self.training.reports,
        )

    def rollout_counters(self) -> dict[str, Any]:
        """The controller's and graders' counters, for a step's metrics row."""
        return {
            **self.controller.stats(),
            **{f"grading_{k}": v for k, v in self.pool.stats().items()},
        }

    # ------------------------------------------------------------------ BatchSource
    async def next_batch(self) -> list[list[Trajectory]]:
        try:
            groups = await self.controller.next_batch()
        except RolloutServerError as exc:
            raise self._server_error(exc) from exc
        return [g.trajectories for g in groups]

    async def after_update(self, trainer_version: int, last_step: bool) -> dict[str, Any]:
        """Publish when the servers lag the trainer by the publication interval (not after
        the last step: the run is over), then the controller's and graders' counters."""
        t_sync = 0.0
        if not last_step and trainer_version - self.controller.published_version >= self.interval:
            t_sync = await self._publish(self.controller)
        metrics: dict[str, Any] = {"time_sync_s": t_sync, PUBLISH_LATENCY_S: self.publish_seconds}
        metrics.update(self.rollout_counters())
        return metrics

    def step_metrics(self, step_seconds: float) -> dict[str, Any]:
        gen_tokens = self.controller.take_generated_tokens()
        return {
            "gen_tokens_per_s": gen_tokens / max(step_seconds, 1e-9),
            **self.supervisor.stats(),
            SERVERS: self.supervisor.servers_by_node(),
        }

    async def final_metrics(self) -> dict[str, Any]:
        return await server_counters(self.client)

    def close(self) -> None:
        if isinstance(self.trainer, TrainerGroup):
            self.trainer.close()
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
    from relayrl.config.loader import prepare_run_dir
    from relayrl.rewards.pool import GradingPool

    if progress is not None:
        config = config.model_copy(
            update={"train": config.train.model_copy(update={"progress": progress})}
        )
    lagged = config.rollout.lag != "async"  # lag emulation: no rollout server (train/lag.py)
    if lagged and resume:
        raise RelayError(
            f"rollout.lag={config.rollout.lag} runs cannot be resumed: the weight snapshots "
            "they generate from are kept in memory only; start the run again"
        )
    torch.set_num_threads(config.runtime.threads)
    model_dir = resolve_model_dir(config, config.train.progress, reuse_sft=resume)
    torch.set_num_threads(config.train.trainer_threads)
    run_dir = prepare_run_dir(config)
    checkpoint = begin_run(run_dir, config, resume)
    if config.rollout.dataset:  # fail on a bad dataset before starting any process
        train_problems(config, None)
    check_loggers(config)  # and on a logger whose package is missing
    check_trainer_ranks(config)  # and on a world size this machine cannot run
    backend = make_backend(config, model_dir)
    launcher = None if lagged else backend.launcher(run_dir)  # checks the backend's env first
    teacher = teacher_launcher(config, run_dir)  # on-policy distillation's teacher server
    pool = GradingPool(
        config.rollout.reward_workers, config.rollout.reward_timeout_s, grader=grader
    )
    job = None
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(config.train.switch_interval_ms / 1000)
    try:
        if teacher is not None:
            config = with_teacher_url(config, teacher.start()[0])
        if launcher is None:
            from relayrl.train.lag import LaggedJob

            job = LaggedJob(config, run_dir, model_dir, None, pool, checkpoint, backend)
            result = asyncio.run(job.loop([]))
        else:
            urls = launcher.start()
            job = _Job(config, run_dir, model_dir, launcher, pool, checkpoint, backend)
            result = asyncio.run(job.loop(urls))
    finally:
        sys.setswitchinterval(switch_interval)
        if launcher is not None:
            launcher.stop()
        if teacher is not None:
            teacher.stop()
        pool.close()
        if job is not None:
            job.close()
    if config.train.save_final:
        out = run_dir / "final_model"
        job.trainer.model.save_pretrained(out)
        job.tokenizer.save_pretrained(out)
    result.summary["final_pass@1"] = result.final_pass_at_1
    result.summary.update(realised_staleness(run_dir / "metrics.jsonl"))
    result.summary.update(drift_summary(run_dir / "metrics.jsonl"))
    with contextlib.suppress(OSError):
        (run_dir / "train_summary.json").write_text(json.dumps(result.summary, indent=2))
    return result
