"""Tools and the tool-calling environments built on them.

Owns: :func:`calc` (arithmetic parsed with ``ast`` and evaluated node by node: never
``eval``), :func:`run_python` (a program run in the code grader's sandbox,
``relayrl.rewards.sandbox``: no network, no host files but the interpreter's, time and
memory limits), :class:`ToolEnvironment` (a model turn that ends in ``<name>argument</name>``
calls tool ``name``; its result comes back as the observation ``<out>result</out>\\n``; a
turn without a call is the final answer, graded by the problem's grader) and the
registered environments ``calc`` and ``python``.

A tool that fails, hangs past ``tool_timeout_s`` or is called malformed answers with an
``error: ...`` observation and counts in the episode (``tool_errors``,
``malformed_calls``); the episode and the run go on — except when the sandbox itself
cannot isolate (``SandboxUnavailable``): that stops the run.

Imports: the standard library, relayrl.rewards.sandbox, relayrl.rollout.environment.
"""

from __future__ import annotations

import ast
import asyncio
import operator
import re
from collections.abc import Awaitable, Callable
from typing import ClassVar

from relayrl.rewards.sandbox import (
    SandboxLimits,
    SandboxUnavailable,
    checked_backend,
    python_argv,
    run_sandboxed,
)
from relayrl.rollout.environment import (
    Environment,
    ModelTurn,
    StepResult,
    register_environment,
)

Tool = Callable[[str], Awaitable[str]]

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**60
MAX_EXPRESSION_CHARS = 200


class ToolError(ValueError):
    """A tool refused its input; the message becomes the observation."""


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {right} is above {MAX_EXPONENT}")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise ToolError("result out of range")
        return value
    raise ToolError(f"unsupported syntax: {type(node).__name__}")


def calc_value(expression: str) -> str:
    """The value of an arithmetic expression (numbers, + - * / // % **, parentheses) as
    text; integral results without a decimal point. Raises :class:`ToolError`."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {expression.strip()!r}") from None
    value = _evaluate(tree)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


async def calc(expression: str) -> str:
    return calc_value(expression)


async def run_python(code: str, limits: SandboxLimits | None = None) -> str:
    """Run ``code`` as a script in the sandbox; its stdout, or ``error: ...``. The sandbox
    is probed on first use (:func:`relayrl.rewards.sandbox.checked_backend`): when it
    cannot isolate, :class:`SandboxUnavailable` stops the run instead of an observation."""
    limits = limits or SandboxLimits(wall_s=5.0, cpu_s=5, memory_mb=512, output_bytes=4096)
    await asyncio.to_thread(checked_backend)
    result = await asyncio.to_thread(
        run_sandboxed, python_argv("tool.py"), {"tool.py": code}, limits
    )
    if result.timed_out:
        raise ToolError(f"timed out after {limits.wall_s:g}s")
    if result.returncode != 0:
        lines = result.stderr.decode("utf-8", "replace").strip().splitlines()
        raise ToolError(f"exit {result.returncode}: {lines[-1] if lines else ''}")
    return result.stdout.decode("utf-8", "replace").strip()


_CALL = re.compile(r"<(\w+)>(.*?)</\1>\s*$", re.DOTALL)
_OPEN = re.compile(r"<(\w+)>")


class ToolEnvironment(Environment):
    """A turn ending in ``<name>argument</name>`` calls tool ``name`` (``tools``); a turn
    with no call is the final answer. Subclass with ``name`` and ``tools``."""

    tools: ClassVar[dict[str, Tool]] = {}
    max_turns = 4
    tool_timeout_s: ClassVar[float] = 10.0

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.stop = tuple(f"</{name}>" for name in cls.tools)

    async def step(self, turn: ModelTurn) -> StepResult:
        call = _CALL.search(turn.text)
        if call is None or call.group(1) not in self.tools:
            opened = [m.group(1) for m in _OPEN.finditer(turn.text) if m.group(1) in self.tools]
            if opened and call is None:
                return self._error(f"unclosed <{opened[-1]}>", malformed=True)
            if call is not None:
                return self._error(f"unknown tool <{call.group(1)}>", malformed=True)
            return StepResult(done=True)
        name, argument = call.group(1), call.group(2)
        try:
            out = await asyncio.wait_for(self.tools[name](argument), self.tool_timeout_s)
        except TimeoutError:
            return self._error(f"{name} timed out after {self.tool_timeout_s:g}s", tool=True)
        except ToolError as exc:
            return self._error(str(exc), tool=True)
        except SandboxUnavailable:
            raise  # not the model's fault: the run stops with one error line
        except Exception as exc:  # noqa: BLE001 - a crashing tool is an observation
            return self._error(f"{name} failed: {type(exc).__name__}: {exc}", tool=True)
        return StepResult(observation=f"<out>{out}</out>\n", metrics={"tool_calls": 1})

    def _error(self, message: str, tool: bool = False, malformed: bool = False) -> StepResult:
        metrics = {"tool_calls": 1.0 if tool else 0.0, "tool_errors": 1.0}
        if malformed:
            metrics["malformed_calls"] = 1.0
        return StepResult(observation=f"<out>error: {message}</out>\n", metrics=metrics)


@register_environment
class CalcEnvironment(ToolEnvironment):
    """A calculator: ``<calc>347*68</calc>`` → ``<out>23596</out>``."""

    name = "calc"
    tools = {"calc": calc}


@register_environment
class PythonEnvironment(ToolEnvironment):
    """A Python interpreter in the sandbox: ``<python>print(2**10)</python>`` → ``<out>1024</out>``."""

    name = "python"
    tools = {"python": run_python}
