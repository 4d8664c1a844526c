"""Code grading: the candidate runs in a sandbox, the tests run outside it.

The verdict is unforgeable by the program under test because the program never runs in the
process that decides it:

* the **candidate process** (sandboxed, see :mod:`relayrl.rewards.sandbox`) executes the
  prompt plus the completion and then only answers calls to the entry point over a pipe;
* the **test process** (the grading worker) executes the problem's trusted test code, and
  the ``candidate`` its ``check`` receives is a proxy that sends the arguments over the pipe
  and decodes the reply with a plain-data codec (exact builtin types only).

A pass requires ``check`` to return normally after at least one call to the candidate.
Whatever the candidate does — exit early, print "PASSED", redefine ``check`` or
``assert`` in its own process, return an object whose ``__eq__`` is always true, write
to the pipe out of turn — it can only produce plain values in answer to calls, which the
trusted test then judges. Each call carries a fresh random nonce that the reply must echo,
so replies cannot be written ahead of the calls they answer.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import select
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relayrl.rewards._code_runner import MAX_LINE_BYTES, decode, encode
from relayrl.rewards.sandbox import (
    SandboxLimits,
    SandboxUnavailable,
    probe_sandbox,
    python_argv,
    start_sandbox,
)

RUNNER = Path(__file__).with_name("_code_runner.py")
_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class CodeVerdict:
    """``passed`` and why not: ``ok`` | ``load_error`` | ``test_failed`` | ``timeout`` |
    ``candidate_died`` | ``protocol_error`` | ``no_calls``."""

    passed: bool
    status: str
    detail: str = ""
    calls: int = 0


class _CandidateGone(BaseException):
    """The candidate process stopped answering; BaseException so tests cannot swallow it."""


class _Deadline(BaseException):
    """The wall-clock budget ran out while waiting for the candidate."""


class CandidateRaised(Exception):
    """The candidate raised; carries the exception type name only."""


def extract_code(completion: str) -> str:
    """The last fenced code block of a chat reply, or the completion itself."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def build_program(prompt: str, completion: str, entry_point: str) -> str:
    """The candidate program: the prompt and the completion's code.

    A completion that defines ``entry_point`` itself is appended after the whole prompt (the
    prompt's imports and helpers stay available; the prompt is left out if it is not valid
    Python on its own); otherwise it continues the prompt (the
    HumanEval convention: the completion is the function body).
    """
    code = extract_code(completion)
    if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE):
        return f"{prompt}\n\n{code}\n" if _compiles(prompt) else f"{code}\n"
    return f"{prompt}{code}\n"


def _compiles(source: str) -> bool:
    try:
        compile(source, "<prompt>", "exec")
        return True
    except (SyntaxError, ValueError):
        return False


class _Channel:
    """The parent's end of the pipe pair to the candidate process."""

    def __init__(self, write_fd: int, read_fd: int, deadline: float) -> None:
        self.write_fd, self.read_fd, self.deadline = write_fd, read_fd, deadline
        self.buffer = b""

    def send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message).encode() + b"\n"
        try:
            while data:
                data = data[os.write(self.write_fd, data) :]
        except (BrokenPipeError, OSError) as exc:
            raise _CandidateGone("candidate closed its input") from exc

    def receive(self) -> dict[str, Any]:
        while b"\n" not in self.buffer:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise _Deadline
            ready, _, _ = select.select([self.read_fd], [], [], left)
            if not ready:
                raise _Deadline
            chunk = os.read(self.read_fd, 1 << 16)
            if not chunk:
                raise _CandidateGone("candidate exited")
            self.buffer += chunk
            if len(self.buffer) > MAX_LINE_BYTES:
                raise _CandidateGone("reply too large")
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            message = json.loads(line)
        except ValueError as exc:
            raise _CandidateGone("malformed reply") from exc
        if not isinstance(message, dict):
            raise _CandidateGone("malformed reply")
        return message


class RemoteFunction:
    """The ``candidate`` handed to the test's ``check``: calls go to the sandbox."""

    def __init__(self, channel: _Channel) -> None:
        self.channel = channel
        self.calls = 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        nonce = secrets.token_hex(8)
        self.channel.send({"args": encode(list(args)), "n": nonce})
        reply = self.channel.receive()
        if reply.get("n") != nonce:  # written before the call was seen: not an answer to it
            raise _CandidateGone("reply out of turn")
        if "ok" in reply:
            try:
                return decode(reply["ok"])
            except (ValueError, TypeError, KeyError) as exc:
                raise _CandidateGone("undecodable reply") from exc
        if "raised" in reply:
            raise CandidateRaised(str(reply["raised"]))
        if "unsupported" in reply:
            raise CandidateRaised(f"returned a non-plain value ({reply['unsupported']})")
        raise _CandidateGone("unexpected reply")


def _run_tests(test_code: str, prompt: str, entry_point: str, candidate: RemoteFunction) -> None:
    namespace: dict[str, Any] = {"__name__": "__relayrl_test__"}
    if _compiles(prompt):  # trusted helpers the tests may use (e.g. HumanEval/32's poly)
        exec(compile(prompt, "<prompt>", "exec"), namespace)
    namespace[entry_point] = candidate  # tests may call the function by name
    exec(compile(test_code, "<test>", "exec"), namespace)
    check = namespace.get("check")
    if not callable(check):
        raise ValueError(f"test code for {entry_point!r} defines no check(candidate)")
    check(candidate)


def grade_code(
    completion: str,
    prompt: str,
    test: str,
    entry_point: str,
    limits: SandboxLimits | None = None,
) -> CodeVerdict:
    """Run ``check(candidate)`` from ``test`` against the sandboxed candidate program."""
    limits = limits or SandboxLimits()
    program = build_program(prompt, completion, entry_point)
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    argv = python_argv("runner.py", "program.py", str(req_r), str(resp_w), entry_point)
    files = {"runner.py": RUNNER.read_text(encoding="utf-8"), "program.py": program}
    try:
        box = start_sandbox(argv, files, limits, pass_fds=(req_r, resp_w))
    finally:
        os.close(req_r)
        os.close(resp_w)
    channel = _Channel(req_w, resp_r, time.monotonic() + limits.wall_s)
    candidate = RemoteFunction(channel)
    try:
        with box:
            verdict = _judge(channel, candidate, test, prompt, entry_point)
            if verdict.status == "candidate_died" and box.wait(0.5):
                lines = box.read_output("stderr").decode("utf-8", "replace").strip()
                if lines:  # the candidate's (or the sandbox's) last words
                    detail = f"{verdict.detail}: {lines.splitlines()[-1][:200]}"
                    verdict = CodeVerdict(False, verdict.status, detail, verdict.calls)
            return verdict
    finally:
        os.close(req_w)
        os.close(resp_r)


def _judge(
    channel: _Channel, candidate: RemoteFunction, test: str, prompt: str, entry_point: str
) -> CodeVerdict:
    try:
        hello = channel.receive()
        if "load_error" in hello:
            return CodeVerdict(False, "load_error", str(hello["load_error"]))
        if hello.get("ready") is not True:
            return CodeVerdict(False, "protocol_error", "no ready message")
        _run_tests(test, prompt, entry_point, candidate)
    except _Deadline:
        return CodeVerdict(False, "timeout", calls=candidate.calls)
    except _CandidateGone as exc:
        return CodeVerdict(False, "candidate_died", str(exc), candidate.calls)
    except Exception as exc:  # an assertion or the candidate's exception, seen by the test
        return CodeVerdict(
            False, "test_failed", f"{type(exc).__name__}: {exc}"[:200], candidate.calls
        )
    if candidate.calls == 0:
        return CodeVerdict(False, "no_calls", "the test never called the candidate")
    return CodeVerdict(True, "ok", calls=candidate.calls)


def grade_code_problem(
    completion: str, meta: dict[str, Any], limits: SandboxLimits | None = None
) -> CodeVerdict:
    """Grade against a code problem's ``meta`` (``prompt``, ``test``, ``entry_point``)."""
    return grade_code(completion, meta["prompt"], meta["test"], meta["entry_point"], limits)


PROBE_PROMPT = "def add(a, b):\n"
PROBE_TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n"


def probe_code_grading() -> str:
    """Probe the sandbox (:func:`relayrl.rewards.sandbox.probe_sandbox`), then grade a
    known-good and a known-bad candidate through it: they must come back ``ok`` and
    ``test_failed``. The backend's name, or :class:`SandboxUnavailable` naming it and the
    cause (a run whose every code reward would silently be 0 stops instead)."""
    backend = probe_sandbox()
    limits = SandboxLimits(wall_s=30.0, cpu_s=10)
    good = grade_code("    return a + b\n", PROBE_PROMPT, PROBE_TEST, "add", limits)
    bad = grade_code("    return a - b\n", PROBE_PROMPT, PROBE_TEST, "add", limits)
    if (good.status, bad.status) != ("ok", "test_failed"):
        raise SandboxUnavailable(
            f"code grading under sandbox backend {backend!r} failed its probe: a known-good "
            f"candidate came back {good.status} ({good.detail or 'no detail'}), a known-bad "
            f"one {bad.status}"
        )
    return backend
