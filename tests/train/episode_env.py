"""A three-turn environment and a task whose problems use it, for end-to-end tests of
multi-turn runs in a subprocess (import this module before relayrl's CLI runs): every
episode has environment tokens whatever the (random) model writes."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, replace

from relayrl.rollout.environment import (
    Environment,
    ModelTurn,
    StepResult,
    register_environment,
)
from relayrl.tasks.arithmetic import ArithmeticTask
from relayrl.tasks.base import Problem
from relayrl.tasks.registry import TASKS, register_task

ENV, TASK = "test_three_turns", "test_three_turn_arithmetic"
TOOL_CALL_S = 0.25


class ThreeTurns(Environment):
    """Two observations, then the episode is graded by the problem's grader."""

    name = ENV
    max_turns = 3
    max_turn_tokens = 8

    def reset(self, problem: Problem) -> str:
        self.turns = 0
        return ""

    async def step(self, turn: ModelTurn) -> StepResult:
        # a slow tool call: episodes outlive a training step, so a kill cuts some mid-way
        # (the tiny model alone finishes all it may admit before the checkpoint is written)
        await asyncio.sleep(TOOL_CALL_S)
        self.turns += 1
        if self.turns == 3:
            return StepResult(done=True)
        return StepResult(observation=" ok\n", metrics={"tool_calls": 1})


@dataclass
class ThreeTurnArithmetic(ArithmeticTask):
    name: str = TASK

    def _sample(self, rng: random.Random, problem_id: str) -> tuple[str, Problem]:
        key, problem = super()._sample(rng, problem_id)
        return key, replace(problem, meta={**problem.meta, "environment": ENV})


if TASK not in TASKS:
    register_environment(ThreeTurns)
    register_task(ThreeTurnArithmetic)
