"""Route a (problem, completion) pair to its grader and return a scalar reward."""

from __future__ import annotations

from relayrl.errors import RelayError
from relayrl.rewards.countdown import verify_countdown
from relayrl.rewards.math import grade_math
from relayrl.tasks.base import Problem


def score(problem: Problem, completion: str) -> float:
    """1.0 for a verified answer, 0.0 otherwise."""
    if problem.grader == "math":
        return float(grade_math(completion, problem.answer))
    if problem.grader == "countdown":
        meta = problem.meta
        return float(verify_countdown(completion, meta["numbers"], meta["target"]))
    raise RelayError(f"problem {problem.id!r} names unknown grader {problem.grader!r}")
