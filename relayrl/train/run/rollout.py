"""The rollout side live and lagged runs share: the controller over a run's prompts and
generate functions, grading in the pool, and its counters.

Owns: :func:`controller_options`, :func:`teacher_scorer`, :class:`RolloutSide`. Imports:
config, the rewards pool, the rollout controller, prompts and workflows, the launch layer's
``ExternalServers`` (the teacher's key proof) and :class:`~relayrl.train.run.setup.RunSetup`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relayrl.config.schema import RunConfig
from relayrl.eval.evaluate import pool_grader
from relayrl.launch.servers import ExternalServers
from relayrl.metric_names import (
    ETA,
    ETA_DRIFT,
    STALE_KL_PER_VERSION,
    STALENESS_SLACK,
    TIME_DRIFT_S,
    TIME_PROX_S,
    TIME_UPDATE_S,
)
from relayrl.rewards.pool import GradingPool
from relayrl.rollout.controller import (
    ControllerOptions,
    PublishedVersion,
    RolloutController,
    auto_concurrency,
    filter_cap,
)
from relayrl.rollout.distill import TeacherScorer
from relayrl.rollout.eta import AutoEta
from relayrl.rollout.prompts import PromptLoader
from relayrl.rollout.workflow import WORKFLOWS, GenerateFn, GenerateGroupFn
from relayrl.runkey import key_from_env
from relayrl.train.run.setup import RunSetup, train_problems


def controller_options(config: RunConfig) -> ControllerOptions:
    """The rollout controller's options from a run's config."""
    r, a = config.rollout, config.algo
    return ControllerOptions(
        n_samples=r.n_samples,
        prompts_per_step=r.prompts_per_step,
        staleness=r.staleness,
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        concurrency=auto_concurrency(r.concurrency, r.prompts_per_step, r.n_samples),
        max_context=config.model.max_context,
        advantage=a.advantage,
        advantage_params=a.params_of("advantage"),
        gamma=a.gamma,
        distill=config.distill.enabled,
        distill_coef=config.distill.coef,
        distill_task_weight=config.distill.task_weight,
        dynamic_sampling=a.dynamic_sampling,
        max_filtered_per_step=filter_cap(a.max_filtered_per_step, r.prompts_per_step),
        overlong_buffer=a.overlong_buffer,
        overlong_penalty=a.overlong_penalty,
        seed=config.seed,
    )


def teacher_scorer(config: RunConfig) -> TeacherScorer | None:
    """The rollout side's client of the distillation teacher (None when off); by now
    ``distill.teacher`` is a URL (a model directory was started by ``run_train``). Before
    the key goes to it, the server at that URL proves that it holds the key, as every
    server someone else started does (:class:`ExternalServers`; RelayError naming the URL)."""
    url = config.distill.teacher
    if url is None:
        return None
    key = config.distill.api_key or key_from_env()
    ExternalServers(
        [url],
        config.rollout.startup_timeout_s,
        api_key=key,
        origin="distill.teacher",
        listed=False,
        key_origin="distill.api_key / $RELAYRL_API_KEY / $RELAYRL_API_KEY_FILE",
    ).start()
    timeout = config.rollout.startup_timeout_s * 5
    return TeacherScorer(url, config.rollout.temperature, timeout, api_key=key)


@dataclass
class RolloutSide:
    """A run's rollout controller and grading pool."""

    controller: RolloutController
    pool: GradingPool
    auto_eta: AutoEta | None = None  # rollout.eta=auto: the rule that moves the bound

    @classmethod
    def build(
        cls,
        setup: RunSetup,
        pool: GradingPool,
        generate_group: GenerateGroupFn,
        generate: GenerateFn,
        published: PublishedVersion | None = None,
    ) -> RolloutSide:
        """The controller over ``setup``'s train prompts and these generate functions (a
        group's samples in one call; one request), grading in ``pool``; it reads the
        published version from ``published`` (a live run's clock; None: its own)."""
        config = setup.config
        controller = RolloutController(
            PromptLoader(train_problems(config, setup.task), seed=config.seed),
            controller_options(config),
            generate_group,
            lambda problem, texts: pool.score_batch([(problem, t) for t in texts]),
            setup.encode,
            setup.decode,
            workflow=WORKFLOWS.lookup(config.rollout.workflow)(),
            generate=generate,
            encode_text=setup.encode_text,
            teacher=teacher_scorer(config),
            published=published,
        )
        # held-out evaluation grades in the pool too when it grades by the problems' own
        # verifiers (not a training reward that replaces them): timeouts, the sandbox,
        # and math-verify in a process's main thread (its signal.alarm timeouts)
        if pool.verifies:
            setup.training.grader = pool_grader(pool)
        return cls(controller, pool, config.rollout.staleness.rule())

    def next_eta(self, stats: dict[str, Any], timed: bool) -> dict[str, Any]:
        """After a step: with ``rollout.eta=auto`` feed the rule the batch's drift (and,
        when ``timed``, the batch's generation latency and the trainer's seconds) and move
        the controller's bound; the step's row gets the bound and the batch's slack."""
        controller = self.controller
        row: dict[str, Any] = {ETA: float(controller.eta)}
        if controller.staleness_slack is not None:
            row[STALENESS_SLACK] = float(controller.staleness_slack)
        if self.auto_eta is None:
            return row
        train_s = sum(float(stats.get(k, 0.0)) for k in (TIME_PROX_S, TIME_UPDATE_S, TIME_DRIFT_S))
        latency = controller.batch_latency_s if timed else None
        eta = self.auto_eta.update(stats.get(STALE_KL_PER_VERSION), latency, train_s)
        controller.set_eta(eta)
        row[ETA] = float(eta)
        if self.auto_eta.drift is not None:
            row[ETA_DRIFT] = self.auto_eta.drift
        return row

    def counters(self) -> dict[str, Any]:
        """The controller's and graders' counters, for a step's metrics row."""
        return {
            **self.controller.stats(),
            **{f"grading_{k}": v for k, v in self.pool.stats().items()},
        }

    def summary(self) -> dict[str, Any]:
        """The controller's and graders' counters, for the run's summary."""
        return {"controller": self.controller.stats(), "grading": self.pool.stats()}
