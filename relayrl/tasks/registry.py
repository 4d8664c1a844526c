"""Look up synthetic tasks by name."""

from __future__ import annotations

import difflib
from typing import Any

from relayrl.errors import RelayError
from relayrl.tasks.arithmetic import ArithmeticTask
from relayrl.tasks.base import SyntheticTask
from relayrl.tasks.countdown import CountdownTask

TASKS: dict[str, type[SyntheticTask]] = {
    "arithmetic": ArithmeticTask,
    "countdown": CountdownTask,
}


def make_task(name: str, params: dict[str, Any] | None = None) -> SyntheticTask:
    if name not in TASKS:
        close = difflib.get_close_matches(name, TASKS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise RelayError(f"unknown task {name!r}{hint}; expected one of {sorted(TASKS)}")
    try:
        return TASKS[name](**(params or {}))
    except TypeError as exc:
        raise RelayError(f"bad parameters for task {name!r}: {exc}") from exc
