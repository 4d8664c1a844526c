"""Countdown: reach a target from given numbers with + - * /, each number used exactly once.

::

    prompt:      Use 3, 7, 12 to make 33.
    completion:  7*3=21
                 21+12=33
                 #### (7*3)+12

The answer line holds an expression; :mod:`relayrl.rewards.countdown` checks that it uses
exactly the given numbers and evaluates to the target. Problems are built by combining the
numbers with random operations whose intermediate results are positive integers, so every
problem has at least one solution (the one in the demonstration).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from relayrl.tasks.base import Problem, SyntheticTask

_OPS = ("+", "-", "*", "/")


def _combine(a: int, b: int, op: str) -> int | None:
    """Result of ``a op b`` when it is a positive integer, else None."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b if a > b else None
    if op == "*":
        return a * b
    return a // b if b > 1 and a % b == 0 else None


@dataclass
class CountdownTask(SyntheticTask):
    min_numbers: int = 3
    max_numbers: int = 4
    max_number: int = 20
    max_target: int = 200
    test_fraction: float = 0.1
    name: str = "countdown"

    def _solve_randomly(self, rng: random.Random, numbers: list[int]):
        """Fold the numbers left to right with random valid ops; returns (steps, value)."""
        order = numbers[:]
        rng.shuffle(order)
        value, expr, steps = order[0], str(order[0]), []
        for b in order[1:]:
            choices = [op for op in _OPS if _combine(value, b, op) is not None]
            op = rng.choice(choices)
            result = _combine(value, b, op)
            steps.append((value, op, b, result))
            expr = f"({expr}){op}{b}" if steps[:-1] else f"{expr}{op}{b}"
            value = result
        return steps, value, expr

    def _sample(self, rng: random.Random, problem_id: str) -> tuple[str, Problem]:
        while True:
            count = rng.randint(self.min_numbers, self.max_numbers)
            numbers = [rng.randint(1, self.max_number) for _ in range(count)]
            steps, target, expr = self._solve_randomly(rng, numbers)
            if 1 <= target <= self.max_target:
                break
        shown = sorted(numbers)
        prompt = f"Use {', '.join(map(str, shown))} to make {target}."
        key = f"{shown}|{target}"
        meta = {
            "numbers": shown,
            "target": target,
            "steps": [list(s) for s in steps],
            "solution": expr,
        }
        return key, Problem(problem_id, prompt, str(target), "countdown", meta)

    def demonstration(self, problem: Problem, rng: random.Random, wrong: bool = False) -> str:
        steps = [tuple(s) for s in problem.meta["steps"]]
        bad_step = rng.randrange(len(steps)) if wrong else -1
        value = steps[0][0]
        expr = str(value)
        lines = []
        for i, (_, op, b, _) in enumerate(steps):
            if i == bad_step:
                others = [o for o in _OPS if o != op and _combine(value, b, o) is not None]
                op = rng.choice(others) if others else op
            elif _combine(value, b, op) is None:  # after a wrong step the old op may not fit
                op = "+"
            result = _combine(value, b, op)
            lines.append(f"{value}{op}{b}={result}")
            expr = f"({expr}){op}{b}" if i else f"{expr}{op}{b}"
            value = result
        lines.append(f"#### {expr}")
        return "\n".join(lines)
