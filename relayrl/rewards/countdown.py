"""Countdown verifier: the answer expression must use exactly the given numbers (each once)
and evaluate to the target. Expressions are parsed with :mod:`ast` and evaluated with exact
fractions over a whitelist of nodes; nothing is ever passed to ``eval``.
"""

from __future__ import annotations

import ast
from collections import Counter
from fractions import Fraction

from relayrl.rewards.extract import extract_hash_answer

MAX_EXPRESSION_CHARS = 200
_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


class _Invalid(Exception):
    pass


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, used)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if right == 0:
            raise _Invalid("division by zero")
        return left / right
    if isinstance(node, ast.Constant) and type(node.value) is int and node.value >= 0:
        used.append(node.value)
        return Fraction(node.value)
    raise _Invalid(f"disallowed syntax: {type(node).__name__}")


def evaluate_expression(expr: str) -> tuple[Fraction, list[int]] | None:
    """Value and the numbers used, or None if ``expr`` is not a plain arithmetic expression."""
    if len(expr) > MAX_EXPRESSION_CHARS or not expr.isascii():
        return None
    try:
        tree = ast.parse(expr, mode="eval")
        used: list[int] = []
        return _evaluate(tree, used), used
    except (SyntaxError, _Invalid, ValueError, RecursionError):
        return None


def verify_countdown(completion: str, numbers: list[int], target: int) -> bool:
    answer = extract_hash_answer(completion)
    if answer is None:
        return False
    result = evaluate_expression(answer.split("=")[0].strip())
    if result is None:
        return False
    value, used = result
    return value == target and Counter(used) == Counter(numbers)
