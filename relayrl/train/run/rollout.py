"""The rollout side live and lagged runs share: the controller over a run's prompts and
generate functions, grading in the pool, and its counters.

Owns: :func:`controller_options`, :class:`RolloutSide`. Imports: config, the rewards pool,
the rollout controller,
prompts and workflows, and :class:`~relayrl.train.run.setup.RunSetup`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relayrl.config.schema import RunConfig
from relayrl.rewards.pool import GradingPool
from relayrl.rollout.controller import (
    ControllerOptions,
    RolloutController,
    auto_concurrency,
    filter_cap,
)
from relayrl.rollout.prompts import PromptLoader
from relayrl.rollout.workflow import WORKFLOWS, GenerateFn, GenerateGroupFn
from relayrl.train.run.setup import RunSetup, train_problems


def controller_options(config: RunConfig) -> ControllerOptions:
    """The rollout controller's options from a run's config."""
    r, a = config.rollout, config.algo
    return ControllerOptions(
        n_samples=r.n_samples,
        prompts_per_step=r.prompts_per_step,
        eta=r.eta,
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        concurrency=auto_concurrency(r.concurrency, r.prompts_per_step, r.n_samples),
        max_context=config.model.max_context,
        advantage=a.advantage,
        dynamic_sampling=a.dynamic_sampling,
        max_filtered_per_step=filter_cap(a.max_filtered_per_step, r.prompts_per_step),
        overlong_buffer=a.overlong_buffer,
        overlong_penalty=a.overlong_penalty,
        seed=config.seed,
    )


@dataclass
class RolloutSide:
    """A run's rollout controller and grading pool."""

    controller: RolloutController
    pool: GradingPool

    @classmethod
    def build(
        cls,
        setup: RunSetup,
        pool: GradingPool,
        generate_group: GenerateGroupFn,
        generate: GenerateFn,
    ) -> RolloutSide:
        """The controller over ``setup``'s train prompts and these generate functions (a
        group's samples in one call; one request), grading in ``pool``."""
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
        )
        return cls(controller, pool)

    def counters(self) -> dict[str, Any]:
        """The controller's and graders' counters, for a step's metrics row."""
        return {
            **self.controller.stats(),
            **{f"grading_{k}": v for k, v in self.pool.stats().items()},
        }

    def summary(self) -> dict[str, Any]:
        """The controller's and graders' counters, for the run's summary."""
        return {"controller": self.controller.stats(), "grading": self.pool.stats()}
