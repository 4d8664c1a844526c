"""Module-level graders for pool tests (spawned workers import them by name)."""

from __future__ import annotations

import os
import time

from relayrl.tasks.base import Problem


def behave(problem: Problem, completion: str) -> float:
    """Misbehave on request: 'raise', 'hang', 'crash'; otherwise reward = completion == answer."""
    if completion == "raise":
        raise ValueError("grader bug")
    if completion == "hang":
        time.sleep(3600)
    if completion == "crash":
        os._exit(3)
    return float(completion == problem.answer)
