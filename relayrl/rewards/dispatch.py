"""Route a (problem, completion) pair to its grader and return a scalar reward.

* ``math`` problems with extraction settings in ``meta['math']`` (benchmarks) go through
  :func:`relayrl.rewards.math.grade_math_answer`; without them (the synthetic arithmetic
  task) through the strict ``#### N`` rule :func:`relayrl.rewards.math.grade_math`;
* ``countdown`` through the Countdown verifier;
* ``code`` through the sandboxed code grader (``meta``: ``prompt``, ``test``, ``entry_point``).

Call these from a grading-pool worker (:mod:`relayrl.rewards.pool`): math-verify needs a
main thread and code runs spawn sandboxes.
"""

from __future__ import annotations

from typing import Any

from relayrl.errors import RelayError
from relayrl.rewards.countdown import verify_countdown
from relayrl.rewards.math import MathGradeConfig, grade_math, grade_math_answer
from relayrl.tasks.base import Problem


def grade_detail(problem: Problem, completion: str) -> tuple[float, dict[str, Any]]:
    """The reward (1.0 or 0.0) and what the grader saw (extracted answer, method, status)."""
    if problem.grader == "math":
        if "math" not in problem.meta:
            return float(grade_math(completion, problem.answer)), {"method": "hash"}
        verdict = grade_math_answer(
            completion, problem.answer, MathGradeConfig.from_meta(problem.meta)
        )
        return float(verdict.correct), {"extracted": verdict.extracted, "method": verdict.method}
    if problem.grader == "countdown":
        meta = problem.meta
        return float(verify_countdown(completion, meta["numbers"], meta["target"])), {}
    if problem.grader == "code":
        from relayrl.rewards.code import grade_code_problem

        result = grade_code_problem(completion, problem.meta)
        return float(result.passed), {"status": result.status, "detail": result.detail}
    raise RelayError(f"problem {problem.id!r} names unknown grader {problem.grader!r}")


def score(problem: Problem, completion: str) -> float:
    """1.0 for a verified answer, 0.0 otherwise."""
    return grade_detail(problem, completion)[0]
