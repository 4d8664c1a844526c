"""The preflight's machinery: checks with deadlines, their order and one line per check.

Owns: :class:`CheckFailed` (what is wrong and the fix), :class:`Check` (a name, the checks
it needs, a deadline and a function of the shared :class:`~relayrl.train.preflight.context.
CheckContext` returning the line's detail), :func:`run_checks` (each check in a daemon
thread joined at its deadline, so a hung check is reported and the others still run; a
check whose prerequisite failed is skipped) and :func:`format_error`.

Imports: relayrl.errors, the standard library.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from relayrl.errors import RelayError


class CheckFailed(RelayError):
    """A check's verdict: ``what`` is wrong, ``fix`` says what to do about it."""

    def __init__(self, what: str, fix: str = "") -> None:
        super().__init__(f"{what} — {fix}" if fix else what)
        self.what = what
        self.fix = fix


@dataclass(frozen=True)
class Check:
    """One check: ``run(context) -> detail``; raises on failure (see :func:`format_error`)."""

    name: str
    run: Callable[[Any], str]
    needs: tuple[str, ...] = ()
    deadline_s: float = 60.0
    fix: str = ""  # the fix of an error whose message does not carry one


@dataclass
class Outcome:
    """How one check ended: ``ok``, ``error`` or ``skip``, with its line's text."""

    name: str
    status: str
    detail: str
    seconds: float = 0.0


@dataclass
class Report:
    """Every check's outcome, in order."""

    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(o.status != "error" for o in self.outcomes)

    def status(self, name: str) -> str | None:
        return next((o.status for o in self.outcomes if o.name == name), None)


def first_line(text: str) -> str:
    """The first non-empty line of ``text`` (plugin errors carry a traceback after it)."""
    return next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")


def format_error(exc: BaseException, fix: str) -> str:
    """``what — fix``: a :class:`CheckFailed` as raised; another error's first line (a
    RelayError says what to do already) with ``fix`` added when the message has no
    ``;``-separated advice of its own."""
    if isinstance(exc, CheckFailed):
        return str(exc)
    message = first_line(str(exc)) or type(exc).__name__
    if not isinstance(exc, RelayError):
        message = f"{type(exc).__name__}: {message}"
    return f"{message} — {fix}" if fix and ";" not in message else message


def _call_with_deadline(check: Check, context: Any) -> Outcome:
    """Run ``check`` in a daemon thread; an error outcome when it raises or passes its
    deadline (the thread is left behind: nothing can stop a Python thread)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["detail"] = check.run(context)
        except BaseException as exc:  # noqa: BLE001 - reported as the check's error
            box["error"] = exc

    start = time.monotonic()
    thread = threading.Thread(target=target, name=f"check-{check.name}", daemon=True)
    thread.start()
    thread.join(check.deadline_s)
    seconds = time.monotonic() - start
    if thread.is_alive():
        what = f"did not finish within its deadline of {check.deadline_s:.0f} s"
        return Outcome(check.name, "error", f"{what} — {check.fix or 'see --debug'}", seconds)
    if "error" in box:
        if getattr(context, "debug", False):
            raise box["error"]
        return Outcome(check.name, "error", format_error(box["error"], check.fix), seconds)
    return Outcome(check.name, "ok", str(box.get("detail", "")), seconds)


def print_outcome(outcome: Outcome, out: TextIO) -> None:
    if outcome.status == "ok":
        line = f"ok   {outcome.name}: {outcome.detail}"
    elif outcome.status == "skip":
        line = f"skip {outcome.name}: {outcome.detail}"
    else:
        line = f"error: {outcome.name}: {outcome.detail}"
    print(line, file=out, flush=True)


def run_checks(checks: Sequence[Check], context: Any, out: TextIO) -> Report:
    """Run ``checks`` in order, printing one line each as it ends; see the module
    docstring."""
    report = Report()
    for check in checks:
        failed = [n for n in check.needs if report.status(n) != "ok"]
        if failed:
            outcome = Outcome(check.name, "skip", f"not run: {', '.join(failed)} did not pass")
        else:
            outcome = _call_with_deadline(check, context)
        report.outcomes.append(outcome)
        if outcome.status == "ok" and hasattr(context, "passed"):
            context.passed.add(check.name)
        print_outcome(outcome, out)
    return report
