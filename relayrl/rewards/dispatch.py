"""Route a (problem, completion) pair to its grader and return a scalar reward.

Owns the grader seam: :data:`GRADERS` maps the name a :class:`~relayrl.tasks.base.Problem`
carries in ``grader`` to a function ``(problem, completion) -> (reward, info)``;
:func:`register_grader` adds one (docs/extending.md). A problem made from a dataset row
carries the whole row as ``problem.row``, so a grader can read its other columns with the
same signature. Built in:

* ``math``: problems with extraction settings in ``meta['math']`` (benchmarks) go through
  :func:`relayrl.rewards.math.grade_math_answer`; without them (the synthetic arithmetic
  task) through the strict ``#### N`` rule :func:`relayrl.rewards.math.grade_math`;
* ``exact``: the final answer read by the same extraction rules as ``math`` (``meta['math']``,
  default ``boxed, answer_is, hash``) must equal the gold text after whitespace removal: no
  number or symbolic equivalence (multiple-choice letters, names, strings);
* ``countdown``: the Countdown verifier;
* ``code``: the sandboxed code grader (``meta``: ``prompt``, ``test``, ``entry_point``);
* ``reasoning_gym``: the answer in the last ``<answer>…</answer>`` (reasoning-gym's own
  convention, what its system prompt asks for), else after ``####`` (``task.params.extract``
  sets other rules, e.g. ``last_number`` for a model that answers in a sentence), scored by
  the reasoning-gym dataset's own
  ``score_answer`` on the item the problem was made from (:mod:`relayrl.tasks.reasoning_gym`).
  relayrl's rewards are 0 or 1 (pass@k counts rewards above 0), so the reward is 1 only at
  reasoning-gym's full score; its own score is in the info (``rg_score``).

Call these from a grading-pool worker (:mod:`relayrl.rewards.pool`): math-verify needs a
main thread and code runs spawn sandboxes. A grader registered outside relayrl must be
registered in a plugin (:mod:`relayrl.plugins`), which the workers import too (they are
spawned processes); an unknown grader fails the item loudly (:class:`UnknownGraderError`).

Imports: relayrl.rewards, relayrl.tasks.base, relayrl.registry, relayrl.errors.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from relayrl.errors import RelayError
from relayrl.registry import Registry
from relayrl.rewards.countdown import verify_countdown
from relayrl.rewards.extract import extract_answer
from relayrl.rewards.math import MathGradeConfig, grade_math, grade_math_answer
from relayrl.tasks.base import Problem


class UnknownGraderError(RelayError):
    """A problem names a grader this process does not know: a configuration error (a
    grading-pool worker fails the item loudly instead of scoring it 0)."""

    fatal = True


GraderFn = Callable[[Problem, str], tuple[float, dict[str, Any]]]
GRADERS: Registry[GraderFn] = Registry("grader")
# graders registered safe (they never evaluate model text: run in-process), name -> function
SAFE_GRADERS: dict[str, GraderFn] = {}


def register_grader(name: str, safe: bool = False) -> Callable[[GraderFn], GraderFn]:
    """Decorator: problems whose ``grader`` is ``name`` are graded by the function, in the
    sandbox unless ``safe`` (the grader promises it never evaluates the completion: no
    ``eval``, ``exec``, ``sympy.parse_expr`` or other code path that runs what it reads)."""

    def add(fn: GraderFn) -> GraderFn:
        GRADERS.add(name, fn)
        if safe:
            SAFE_GRADERS[name] = fn
        return fn

    return add


@register_grader("math", safe=True)
def _grade_math(problem: Problem, completion: str) -> tuple[float, dict[str, Any]]:
    if "math" not in problem.meta:
        return float(grade_math(completion, problem.answer)), {"method": "hash"}
    verdict = grade_math_answer(completion, problem.answer, MathGradeConfig.from_meta(problem.meta))
    return float(verdict.correct), {"extracted": verdict.extracted, "method": verdict.method}


@register_grader("exact", safe=True)
def _grade_exact(problem: Problem, completion: str) -> tuple[float, dict[str, Any]]:
    found = extract_answer(completion, MathGradeConfig.from_meta(problem.meta).all_modes())
    if found is None:
        return 0.0, {"extracted": None, "method": "no_answer"}
    same = "".join(found.text.split()) == "".join(problem.answer.split())
    return float(same), {"extracted": found.text, "method": "exact"}


@register_grader("countdown", safe=True)
def _grade_countdown(problem: Problem, completion: str) -> tuple[float, dict[str, Any]]:
    meta = problem.meta
    return float(verify_countdown(completion, meta["numbers"], meta["target"])), {}


@register_grader("code", safe=True)
def _grade_code(problem: Problem, completion: str) -> tuple[float, dict[str, Any]]:
    from relayrl.rewards.code import grade_code_problem  # sandbox machinery, loaded on use

    result = grade_code_problem(completion, problem.meta)
    return float(result.passed), {"status": result.status, "detail": result.detail}


DEFAULT_RG_EXTRACT = ("tag", "hash")


@register_grader("reasoning_gym")
def _grade_reasoning_gym(problem: Problem, completion: str) -> tuple[float, dict[str, Any]]:
    from relayrl.tasks.reasoning_gym import dataset_of, item_of  # reasoning-gym, on use

    modes = problem.meta.get("extract") or DEFAULT_RG_EXTRACT
    found = extract_answer(completion, modes)
    answer = found.text if found is not None else None
    rg_score = 0.0
    if answer is not None:
        rg_score = float(dataset_of(problem).score_answer(answer, item_of(problem)))
    return float(rg_score >= 1.0), {"extracted": answer, "rg_score": rg_score}


def _warm_reasoning_gym(problem: Problem) -> None:
    """Open the problem's dataset (imports, generators) before any answer is read: the
    isolated grader's scoring children then share it (relayrl.rewards.isolated)."""
    from relayrl.tasks.reasoning_gym import dataset_of

    dataset_of(problem)


_grade_reasoning_gym.warm = _warm_reasoning_gym  # type: ignore[attr-defined]


def grade_detail(problem: Problem, completion: str) -> tuple[float, dict[str, Any]]:
    """The reward (1.0 or 0.0) and what the grader saw (extracted answer, method, status)."""
    grader = GRADERS.get(problem.grader)
    if grader is None:
        raise UnknownGraderError(
            f"problem {problem.id!r} names unknown grader {problem.grader!r} in process "
            f"{os.getpid()}; registered: {sorted(GRADERS)}. A grader registered outside "
            "relayrl must be in a plugin (plugins: [...] in the config or --plugin), which "
            "every process imports, not in a script's `if __name__ == '__main__'` block"
        )
    if SAFE_GRADERS.get(problem.grader) is grader:
        return grader(problem, completion)
    from relayrl.rewards.isolated import grade_isolated  # the sandbox, on use

    return grade_isolated(problem.grader, problem, completion)


def score(problem: Problem, completion: str) -> float:
    """1.0 for a verified answer, 0.0 otherwise."""
    return grade_detail(problem, completion)[0]
