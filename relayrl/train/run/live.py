"""A live run's batch source: the rollout controller's batches from the rollout servers,
weight publication after each update, held-out evaluation on the servers.

Process layout (docs/async.md): the rollout servers are ``relayrl serve`` child processes
(``relayrl.launch.servers``); this process runs the controller (asyncio), the grading pool's
feeder threads and the trainer, whose optimizer steps run in a worker thread so the event
loop keeps feeding the servers meanwhile.

Publication every ``train.publish_every`` steps (at least every η + 1 steps, else the
admission bound would starve the trainer) goes through :class:`relayrl.sync.weight_sync.WeightSync`,
the one owner of which weights the servers serve (its ``VersionClock`` holds the published
version; the controller's admission reads that same clock). Reliability
(docs/reliability.md): checkpoints every ``train.checkpoint_every`` steps and on
SIGINT/SIGTERM (:class:`RunCheckpoints`), resume from one; dead or hung rollout servers are
restarted with the weights ``WeightSync`` names and their requests resubmitted
(``relayrl.launch.supervisor``).

Owns: :class:`LiveSource`, :func:`server_counters`, :data:`TIME_EVAL_PUBLISH_S`.
Imports: config, engine client, errors, eval, the launch layer's backends and supervisor,
relayrl.sync (weight publication and its transports), the rewards pool, the rollout
controller, checkpoints, and the run package's setup and rollout side.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from relayrl.config.schema import EvalConfig
from relayrl.engine.client import RolloutClient, RolloutServerError
from relayrl.errors import RelayError
from relayrl.eval.evaluate import EvalReport, WeightsChanged, evaluate, in_process_grader
from relayrl.eval.remote import RemoteEngine
from relayrl.launch.backends import RolloutBackend
from relayrl.launch.servers import ExternalServers, ServerLauncher
from relayrl.launch.supervisor import ServerSupervisor
from relayrl.metric_names import (
    GEN_TOKENS_PER_S,
    PUBLISH_LATENCY_S,
    ROLLOUT_ENGINE,
    SERVERS,
    TIME_SYNC_S,
)
from relayrl.rewards.pool import GradingPool
from relayrl.rollout.trajectory import Trajectory
from relayrl.sync.clock import VersionClock
from relayrl.sync.transports import make_publisher
from relayrl.sync.weight_sync import WeightSync, publish_interval
from relayrl.tasks.base import Problem
from relayrl.train.checkpoint import Checkpoint
from relayrl.train.resume import RunCheckpoints, StopRequested, StopSignal
from relayrl.train.run.rollout import RolloutSide
from relayrl.train.run.setup import RunSetup, TrainResult

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
    "kept_version",
    "shared_prefill_tokens",
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
    counters = {f"server_{k}": float(sum(i[k] for i in infos)) for k in SERVER_COUNTERS}
    if all("peak_rss_mb" in i for i in infos):  # the largest server's
        counters["server_peak_rss_mb"] = float(max(i["peak_rss_mb"] for i in infos))
    return counters


class LiveSource:
    """The :class:`~relayrl.train.loop.BatchSource` of a live run, connected to its
    servers (:meth:`connect`); :meth:`train` runs the setup's loop over it."""

    def __init__(
        self,
        setup: RunSetup,
        launcher: ServerLauncher | ExternalServers,
        client: RolloutClient,
        supervisor: ServerSupervisor,
        rollout: RolloutSide,
        sync: WeightSync,
    ) -> None:
        config = setup.config
        self.setup, self.launcher, self.client = setup, launcher, client
        self.supervisor, self.rollout, self.sync = supervisor, rollout, sync
        self.controller = rollout.controller
        self.checkpoints = RunCheckpoints(
            setup.run_dir,
            config.train.checkpoint_every,
            config.train.keep_checkpoints,
            setup.trainer,
            setup.tokenizer,
        )
        self.checkpoints.register("controller", self.controller)
        if rollout.auto_eta is not None:
            self.checkpoints.register("auto_eta", rollout.auto_eta, required=False)

    @classmethod
    async def connect(
        cls,
        setup: RunSetup,
        pool: GradingPool,
        launcher: ServerLauncher | ExternalServers,
        backend: RolloutBackend,
        urls: list[str],
        weights: Path,
    ) -> LiveSource:
        """Check the servers at ``urls`` and build the controller, supervisor and weight
        sync over them (published weights go under ``weights``)."""
        cfg = setup.config
        client = backend.client(urls, timeout=3600.0)
        publisher = make_publisher(cfg.train)
        try:
            await backend.check_servers(client)
        except RolloutServerError:
            pass  # unreachable: it died since it started; the supervisor restarts or names it
        except BaseException:
            await client.close()
            raise
        supervisor = ServerSupervisor(
            launcher,
            client,
            0 if cfg.rollout.server_urls else cfg.rollout.max_server_restarts,
            cfg.rollout.server_hang_timeout_s,
        )
        clock = VersionClock(setup.trainer)  # WeightSync moves it, the controller reads it
        rollout = RolloutSide.build(
            setup,
            pool,
            # one HTTP exchange per group (its n samples as one batched /generate)
            lambda ids, params, key: client.generate_many([ids] * len(params), params, key=key),
            # later turns of multi-turn episodes: one request each, resubmitted after aborts
            lambda ids, params, key: client.generate(ids, params, key=key),
            published=clock,
        )
        served = cfg.served_dtype if cfg.served_dtype != cfg.model.dtype else None
        sync = WeightSync.for_run(
            setup.trainer,
            rollout.controller,
            supervisor,
            publisher,
            weights,
            cfg.train,
            served,
            clock=clock,
        )
        return cls(setup, launcher, client, supervisor, rollout, sync)

    @property
    def interval(self) -> int:
        """Steps between publications, at most the bound in force + 1 (it moves with
        ``rollout.eta=auto``)."""
        return publish_interval(self.setup.config.train.publish_every, self.controller.eta)

    # ------------------------------------------------------------------ the run
    async def train(self, resume_from: Checkpoint | None) -> TrainResult:
        """Resume (if ``resume_from``), start the controller and the watchdog, run the
        loop; on a stop signal checkpoint and raise :class:`StopRequested`."""
        cfg, training = self.setup.config, self.setup.training
        if cfg.eval.backend == "servers":
            training.evaluator = self.evaluate_on_servers
        first = await self._resume(resume_from)
        self.controller.start()
        watch = asyncio.create_task(self.supervisor.watch(self.controller.fail))

        def on_stop(exc: BaseException) -> None:
            # Ctrl-C reaches the servers too: one that exits now is not restarted
            watch.cancel()
            self.controller.fail(exc)

        stop = StopSignal(on_stop)
        stop.install()
        training.on_step_end = lambda done: self.checkpoints.after_step(
            done, cfg.train.total_steps, stop
        )
        start = time.perf_counter()
        try:
            final = await training.run(self, first)
        except StopRequested:
            await self.checkpoints.save_and_stop(training.steps_done)
            raise
        except (RolloutServerError, OSError) as exc:
            raise await self._server_error(exc) from exc
        finally:
            stop.uninstall()
            watch.cancel()
            await self.sync.cancel()
            await self.controller.stop()
            self.sync.close()
            await self.client.close()
        summary = {
            **self.rollout.summary(),
            ROLLOUT_ENGINE: cfg.rollout.engine,
            **self.sync.summary(),
            **self.supervisor.stats(),  # the run's restarts, the final evaluation's included
        }
        return self.setup.result(final, time.perf_counter() - start, summary)

    async def _resume(self, resume_from: Checkpoint | None) -> int:
        """Restore the checkpoint being resumed (if any) and publish its weights to the
        servers; returns the number of steps already done."""
        if resume_from is None:
            return 0
        controller = self.controller
        done = self.checkpoints.restore(resume_from)
        if self.rollout.auto_eta is not None:  # rollout.eta=auto: the bound it had reached
            controller.set_eta(self.rollout.auto_eta.eta)
        versions = (done, self.setup.trainer.version, controller.consumed_version)
        assert len(set(versions)) == 1, f"checkpoint step, trainer, controller: {versions}"
        await self.sync.publish(wait=True)
        if controller.failure is not None:
            raise controller.failure
        ready, running = controller.restored_counts()
        print(
            f"resumed from {resume_from.path}: {ready} complete groups and {running} "
            "in-flight prompts restored",
            flush=True,
        )
        return done

    async def _server_error(self, exc: BaseException) -> RelayError:
        await asyncio.sleep(0.5)  # let a dying server's exit status show (loop keeps running)
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

        The servers are first brought to the trainer's version
        (:meth:`WeightSync.servers_to_trainer`). No publication lands while it runs: only
        the training loop starts publications (:meth:`after_update`) and the loop is here,
        awaiting this. The supervisor's lock is not held, so a server that fails meanwhile
        is restarted as always (with the newest disk snapshot, the trainer's version under
        the disk transport) and its requests are resubmitted there."""
        start = time.perf_counter()
        await self.sync.servers_to_trainer()
        published = time.perf_counter() - start
        loop = asyncio.get_running_loop()
        tokenizer, system = self.setup.tokenizer, self.setup.config.model.system_prompt

        grader = self.setup.training.grader or in_process_grader

        def run() -> EvalReport:  # in a worker thread: the requests go to this loop
            with RemoteEngine.sharing(self.client, loop) as engine:
                return evaluate(
                    engine, tokenizer, problems, cfg, seed=seed, system_prompt=system, grader=grader
                )

        try:
            report = await asyncio.to_thread(run)
        except WeightsChanged as exc:
            raise RelayError(f"eval.backend=servers: {exc}") from exc
        return report, {TIME_EVAL_PUBLISH_S: published}

    # ------------------------------------------------------------------ BatchSource
    async def next_batch(self) -> list[list[Trajectory]]:
        try:
            groups = await self.controller.next_batch()
        except RolloutServerError as exc:
            raise await self._server_error(exc) from exc
        return [g.trajectories for g in groups]

    async def after_update(self, trainer_version: int, last_step: bool) -> dict[str, Any]:
        """Publish when the servers lag the trainer by the publication interval (not after
        the last step: the run is over), then the controller's and graders' counters."""
        bound = self.rollout.next_eta(self.setup.training.last_stats, timed=True)
        t_sync = await self.sync.maybe_publish(self.interval, last_step)
        metrics: dict[str, Any] = {
            TIME_SYNC_S: t_sync,
            PUBLISH_LATENCY_S: self.sync.seconds,
            **bound,
        }
        metrics.update(self.rollout.counters())
        return metrics

    def step_metrics(self, step_seconds: float) -> dict[str, Any]:
        gen_tokens = self.controller.take_generated_tokens()
        return {
            GEN_TOKENS_PER_S: gen_tokens / max(step_seconds, 1e-9),
            **self.supervisor.stats(),
            SERVERS: self.supervisor.row_view(),
        }

    async def final_metrics(self) -> dict[str, Any]:
        return await server_counters(self.client)
