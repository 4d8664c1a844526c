"""Graders that read model-written text the way it could run: in the code sandbox.

Owns :class:`IsolatedGrader` and :func:`grade_isolated`, which :func:`relayrl.rewards.
dispatch.grade_detail` uses for every grader not registered ``safe=True``: reasoning-gym's
``score_answer`` (several of its datasets ``eval`` the answer, others
``sympy.parse_expr`` it) and a plugin's graders unless they declare themselves safe.

One sandboxed process per grader and grading process (:func:`relayrl.rewards.sandbox.
start_sandbox`: no network, a read-only minimal root plus the interpreter's environment,
the relayrl package and the plugins' files, a scrubbed environment, a scratch tmpfs) imports
the grader once; each item is scored in a fresh ``fork`` of it that dies after its one
reply (:mod:`relayrl.rewards._grader_runner`), and the process itself (not dumpable: a
child cannot trace it) is replaced every ``batch_items`` items, so a scorer patched by one
answer never grades another. Replies are JSON (never unpickled). A process that cannot
start raises :class:`~relayrl.rewards.sandbox.SandboxUnavailable` (the run stops with one
``error:`` line: never a silent reward of 0); an item that kills or hangs its process
scores 0 (``info["status"] == "scorer_died"``) and the next item starts a fresh one.

Imports: the standard library, relayrl.rewards.sandbox, relayrl.rewards.code (the pipe
channel), relayrl.plugins, relayrl.tasks.base, relayrl.errors.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from relayrl.errors import RelayError
from relayrl.rewards.code import _CandidateGone, _Channel, _Deadline
from relayrl.rewards.sandbox import (
    SandboxLimits,
    SandboxProcess,
    SandboxUnavailable,
    start_sandbox,
)
from relayrl.tasks.base import Problem

RUNNER = Path(__file__).with_name("_grader_runner.py")
START_TIMEOUT_S = 120.0
ITEM_TIMEOUT_S = 10.0
BATCH_ITEMS = 256  # items per grading process (each item in a fresh fork of it)
LIMITS = SandboxLimits(cpu_s=300, memory_mb=4096, nproc=4, nofile=256, disk_mb=32)
THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
SCRATCH_ENV = {"MPLCONFIGDIR": "/tmp/mpl", "TMPDIR": "/tmp"}  # the sandbox's private tmpfs


class IsolatedGraderError(Exception):
    """The isolated grader raised on one item (reward 0, status ``error``); its message
    starts with the original exception's type name."""


def _plugin_paths() -> tuple[list[str], list[str]]:
    """(binds, sys.path entries) for the plugins of ``RELAYRL_PLUGINS``: a file plugin
    alone, a module plugin's top-level package (or module) and its parent directory."""
    from relayrl.plugins import ENV

    binds, path = [], []
    for spec in json.loads(os.environ.get(ENV) or "[]"):
        if spec.endswith(".py") or "/" in spec:
            binds.append(spec)
            continue
        found = importlib.util.find_spec(spec.split(".")[0])
        if found is None or found.origin is None:
            continue
        top = Path(found.origin).parent if found.submodule_search_locations else Path(found.origin)
        binds.append(str(top))
        path.append(str(top.parent))
    return binds, path


def _environment() -> tuple[tuple[str, ...], list[str]]:
    """What the grading process must see: this interpreter's environment (a venv), the
    relayrl package and the plugins; and the directories to put on its ``sys.path``."""
    import relayrl

    package = Path(relayrl.__file__).resolve().parent
    binds = [sys.prefix, *(p for p in sys.path if "site-packages" in p), str(package)]
    extra = _import_dirs()
    plugin_binds, path = _plugin_paths()
    return (
        tuple(dict.fromkeys([*binds, *extra, *plugin_binds])),
        [str(package.parent), *extra, *path],
    )


def _import_dirs() -> list[str]:
    """The directories this interpreter imports from beyond its own prefix: ``PYTHONPATH``
    and ``.pth`` entries (packages installed with ``pip --target``, say). The runner starts
    with ``-I``, so without them a grader's imports (reasoning-gym's) fail in the sandbox.
    The working directory is left out: it holds the run's files, not packages."""
    cwd = os.getcwd()
    prefixes = [Path(p).resolve() for p in {sys.prefix, sys.base_prefix}]
    dirs = []
    for entry in sys.path:
        if not entry or "site-packages" in entry or not os.path.isdir(entry):
            continue
        resolved = Path(entry).resolve()
        if str(resolved) == cwd or any(resolved.is_relative_to(p) for p in prefixes):
            continue
        dirs.append(entry)
    return dirs


def _problem_json(problem: Problem) -> dict[str, Any]:
    data = dataclasses.asdict(problem)
    try:
        json.dumps(data)
    except (TypeError, ValueError) as exc:
        raise SandboxUnavailable(
            f"problem {problem.id!r}: its fields must be JSON to be graded in isolation "
            f"(grader {problem.grader!r}): {exc}"
        ) from None
    return data


class IsolatedGrader:
    """The sandboxed grading process of one grader, started on first use."""

    def __init__(self, grader: str, batch_items: int = BATCH_ITEMS) -> None:
        self.grader, self.batch_items = grader, batch_items
        self._box: SandboxProcess | None = None
        self._channel: _Channel | None = None
        self._fds: tuple[int, int] = (-1, -1)
        self._served = 0
        self._lock = threading.Lock()

    def grade(self, problem: Problem, completion: str) -> tuple[float, dict[str, Any]]:
        """The grader's (reward, info) for one item, scored in a fresh child process."""
        data = _problem_json(problem)
        with self._lock:
            channel = self._channel or self._start()
            item = {"i": self._served, "problem": data, "completion": completion}
            reply = self._exchange(channel, item)
            self._served += 1
            if self._served >= self.batch_items:
                self.close()
        return _verdict(reply)

    def _start(self) -> _Channel:
        binds, path = _environment()
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        config = {
            "request_fd": req_r, "reply_fd": resp_w, "grader": self.grader,
            "item_timeout_s": ITEM_TIMEOUT_S, "path": path,
        }  # fmt: skip
        # this interpreter (its venv's packages), not the sandbox's bare base interpreter
        argv = [sys.executable, "-I", "runner.py", json.dumps(config)]
        env = {
            **THREAD_ENV,
            **SCRATCH_ENV,
            "RELAYRL_PLUGINS": os.environ.get("RELAYRL_PLUGINS", "[]"),
        }
        files = {"runner.py": RUNNER.read_text(encoding="utf-8")}
        try:
            self._box = start_sandbox(
                argv, files, LIMITS, pass_fds=(req_r, resp_w), env=env, binds=binds
            )
        finally:
            os.close(req_r)
            os.close(resp_w)
        self._fds, self._served = (req_w, resp_r), 0
        self._channel = _Channel(req_w, resp_r, time.monotonic() + START_TIMEOUT_S)
        hello = self._hello(self._channel)
        if hello.get("ready") is not True:
            self.close()
            raise SandboxUnavailable(
                f"isolated grader {self.grader!r} could not start in the sandbox: "
                f"{hello.get('fatal', hello)}"
            )
        return self._channel

    def _exchange(self, channel: _Channel, item: dict[str, Any]) -> dict[str, Any]:
        channel.deadline = time.monotonic() + ITEM_TIMEOUT_S + 30.0
        try:
            channel.send(item)
            reply = channel.receive()
        except (_CandidateGone, _Deadline) as exc:  # the item killed or hung its process
            self.close()
            return {"died": f"the grading process ended: {type(exc).__name__.strip('_')} {exc}"}
        if reply.get("i") != item["i"]:
            self.close()
            return {"died": "the grading process replied out of turn"}
        if "fatal" in reply:  # its set-up failed: every item would score 0
            self.close()
            raise SandboxUnavailable(
                f"isolated grader {self.grader!r} could not set up problem "
                f"{item['problem'].get('id')!r} in the sandbox: {reply['fatal']}"
            )
        return reply

    def _hello(self, channel: _Channel) -> dict[str, Any]:
        try:
            return channel.receive()
        except (_CandidateGone, _Deadline) as exc:
            last = self._last_words()
            self.close()
            raise SandboxUnavailable(
                f"isolated grader {self.grader!r} could not start in the sandbox: "
                f"{type(exc).__name__.strip('_')} {exc}{last}"
            ) from None

    def _last_words(self) -> str:
        if self._box is None or not self._box.wait(1.0):
            return ""
        lines = self._box.read_output("stderr").decode("utf-8", "replace").strip().splitlines()
        return f"; exit {self._box.proc.returncode}: {lines[-1][:300]}" if lines else ""

    def close(self) -> None:
        """Stop the sandboxed process (the next item starts a fresh one)."""
        box, self._box, self._channel = self._box, None, None
        for fd in self._fds:
            if fd >= 0:
                os.close(fd)
        self._fds = (-1, -1)
        if box is not None:
            box.close()


def _verdict(reply: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    if "reward" in reply:
        info = reply.get("info")
        return float(reply["reward"]), {**(info if isinstance(info, dict) else {})}
    if "raised" in reply:
        raise _remote_error(str(reply["raised"]), str(reply.get("message", "")))
    return 0.0, {"status": "scorer_died", "detail": str(reply.get("died", ""))}


def _remote_error(type_name: str, message: str) -> Exception:
    """An exception named like the one the isolated grader raised (the pool reports
    ``TypeName: message``)."""
    name = type_name if type_name.isidentifier() else "IsolatedGraderError"
    return type(name, (IsolatedGraderError,), {})(message)


_GRADERS: dict[str, IsolatedGrader] = {}
_GRADERS_LOCK = threading.Lock()


def grade_isolated(name: str, problem: Problem, completion: str) -> tuple[float, dict[str, Any]]:
    """Grade with the registered grader ``name`` in this process's isolated grader."""
    with _GRADERS_LOCK:
        grader = _GRADERS.get(name)
        if grader is None:
            grader = _GRADERS[name] = IsolatedGrader(name)
    return grader.grade(problem, completion)


@atexit.register
def close_all() -> None:
    """Stop every isolated grading process of this process."""
    for grader in list(_GRADERS.values()):
        try:
            grader.close()
        except (OSError, RelayError):
            pass
