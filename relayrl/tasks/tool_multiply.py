"""Multiplication with a calculator tool: operands too large for a small model to multiply
in its head, and a ``calc`` tool it may call (the ``calc`` environment,
``relayrl.rollout.tools``).

    prompt:        Multiply 347*68.
    with the tool: <calc>347*68</calc>      (model turn, stops at </calc>)
                   <out>23596</out>         (observation: environment tokens)
                   #### 23596               (model turn)
    guessing:      #### 61830

Demonstrations for the SFT warm start call the tool unless ``wrong`` (``sft.wrong_fraction``
of them), in which case they guess: a random number of the product's length (wrong by
construction, and unrelated to the operands, so the warm start learns no shortcut). The SFT model therefore calls the tool at about
``1 - wrong_fraction`` of its problems and is right about that often; RL raises both.
Problems are graded by the ``#### N`` rule on the model's own text (``math`` grader).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from relayrl.tasks.base import Problem, SyntheticTask


@dataclass
class ToolMultiplyTask(SyntheticTask):
    digits_a: int = 3
    digits_b: int = 2
    test_fraction: float = 0.1
    name: str = "tool_multiply"

    def _sample(self, rng: random.Random, problem_id: str) -> tuple[str, Problem]:
        a = rng.randrange(10 ** (self.digits_a - 1), 10**self.digits_a)
        b = rng.randrange(10 ** (self.digits_b - 1), 10**self.digits_b)
        meta = {"a": a, "b": b, "environment": "calc"}
        return f"{a}*{b}", Problem(problem_id, f"Multiply {a}*{b}.", str(a * b), "math", meta)

    def _guess(self, product: int, rng: random.Random) -> int:
        digits = len(str(product))
        while True:
            guess = rng.randrange(10 ** (digits - 1), 10**digits)
            if guess != product:
                return guess

    def demonstration_segments(
        self, problem: Problem, rng: random.Random, wrong: bool = False
    ) -> list[tuple[str, bool]]:
        product = int(problem.answer)
        if wrong:
            return [(f"#### {self._guess(product, rng)}", True)]
        a, b = problem.meta["a"], problem.meta["b"]
        return [
            (f"<calc>{a}*{b}</calc>", True),
            (f"<out>{product}</out>\n", False),
            (f"#### {product}", True),
        ]

    def demonstration(self, problem: Problem, rng: random.Random, wrong: bool = False) -> str:
        return "".join(text for text, _ in self.demonstration_segments(problem, rng, wrong))
