"""Look up synthetic tasks by name: the task seam.

A new task is one :class:`~relayrl.tasks.base.SyntheticTask` subclass (its ``name``, a
problem sampler and a demonstration writer; its problems name a registered grader) plus
:func:`register_task`; ``task.name=<name>`` then selects it (docs/extending.md).

Imports: relayrl.tasks, relayrl.registry, relayrl.errors.
"""

from __future__ import annotations

from typing import Any

from relayrl.errors import RelayError
from relayrl.registry import Registry
from relayrl.tasks.arithmetic import ArithmeticTask
from relayrl.tasks.base import SyntheticTask
from relayrl.tasks.countdown import CountdownTask
from relayrl.tasks.reasoning_gym import ReasoningGymTask
from relayrl.tasks.tool_multiply import ToolMultiplyTask

TASKS: Registry[type[SyntheticTask]] = Registry("task", SyntheticTask)


def register_task(cls: type[SyntheticTask]) -> type[SyntheticTask]:
    """Make ``cls`` selectable as ``task.name=cls.name`` (usable as a class decorator)."""
    return TASKS.add_class(cls)


register_task(ArithmeticTask)
register_task(CountdownTask)
register_task(ToolMultiplyTask)
register_task(ReasoningGymTask)


def make_task(name: str, params: dict[str, Any] | None = None) -> SyntheticTask:
    try:
        cls = TASKS.lookup(name)
    except ValueError as exc:
        raise RelayError(str(exc)) from None
    try:
        return cls(**(params or {}))
    except TypeError as exc:
        raise RelayError(f"bad parameters for task {name!r}: {exc}") from exc
