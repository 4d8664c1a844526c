"""The rollout side live and lagged runs share: the controller over a run's prompts and
generate functions, grading in the pool, and its counters.

Owns: :class:`RolloutSide`. Imports: config, the rewards pool, the rollout controller,
prompts and workflows, and :class:`~relayrl.train.run.setup.RunSetup`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relayrl.rewards.pool import GradingPool
from relayrl.rollout.controller import ControllerOptions, RolloutController
from relayrl.rollout.prompts import PromptLoader
from relayrl.rollout.workflow import WORKFLOWS, GenerateFn, GenerateGroupFn
from relayrl.train.run.setup import RunSetup, train_problems


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
            ControllerOptions.from_config(config),
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
