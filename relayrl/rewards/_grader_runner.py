"""Inside side of isolated grading (:mod:`relayrl.rewards.isolated`): runs in the sandbox.

``python -I _grader_runner.py CONFIG_JSON``; the config names the request and reply pipe
fds, the grader, the per-item deadline and the directories to put on ``sys.path``. The runner
imports the plugins (``RELAYRL_PLUGINS``) and looks the grader up once, says
``{"ready": true}`` (or ``{"fatal": msg}``), then for each request line
``{"i": N, "problem": {...}, "completion": "..."}`` forks a fresh child that scores the item
and dies (a grader's ``warm(problem)``, when it has one, runs first in the runner
itself, on the trusted problem alone: reasoning-gym opens the dataset there once), so nothing the scorer (or the model text it evaluates) changes in its process
reaches the next item. The reply is ``{"i": N, "reward": x, "info": {...}}``,
``{"i": N, "raised": TypeName, "message": "..."}`` or ``{"i": N, "died": "..."}``; a
``warm`` that raises (the grader's own set-up, e.g. an import it cannot find) replies
``{"i": N, "fatal": msg}`` and the runner ends: the host stops the run, since every item
would score 0.

The child refuses, by an audit hook, process creation, signals, sockets and
opening files for writing outside the scratch ``/tmp``: defence in depth inside the sandbox, whose namespaces and
read-only root are what hold.

Imports: the standard library; relayrl (plugins, rewards.dispatch, tasks.base) on start.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from typing import Any

MAX_REPLY_BYTES = 1 << 20
PR_SET_DUMPABLE = 4
REFUSED_EVENTS = (
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
    "os.kill", "os.killpg", "subprocess.Popen", "socket.", "pty.",
)  # fmt: skip
SCRATCH = "/tmp/"  # the sandbox's private tmpfs: the only place a scorer may write
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _refuse(event: str, args: tuple[Any, ...]) -> None:
    """Audit hook of a scoring child: no processes, signals, sockets or writes."""
    if event.startswith(REFUSED_EVENTS):
        raise PermissionError(f"isolated grader: {event} refused")
    if event == "open" and len(args) >= 3 and not str(args[0]).startswith(SCRATCH):
        mode, flags = args[1], args[2]
        writing = isinstance(mode, str) and any(c in mode for c in "wax+")
        if writing or (isinstance(flags, int) and flags & WRITE_FLAGS):
            raise PermissionError("isolated grader: opening a file for writing refused")


def _problem(item: dict[str, Any]) -> Any:
    from relayrl.tasks.base import Problem

    return Problem(**item["problem"])


def _score(grader: Any, item: dict[str, Any]) -> dict[str, Any]:
    problem = _problem(item)
    sys.addaudithook(_refuse)
    try:
        out = grader(problem, item["completion"])
        reward, info = out if isinstance(out, tuple) else (out, {})
        return {"reward": float(reward), "info": dict(info)}
    except Exception as exc:  # the grader's (or the model text's) error: reward 0, counted
        return {"raised": type(exc).__name__, "message": str(exc)[:400]}


def _child(grader: Any, item: dict[str, Any], write_fd: int) -> None:
    """Score one item and write one JSON line on ``write_fd``; never returns."""
    try:
        line = json.dumps(_score(grader, item), default=str).encode() + b"\n"
        os.write(write_fd, line[:MAX_REPLY_BYTES])
    finally:
        os._exit(0)


def _read_reply(read_fd: int, deadline: float) -> bytes | None:
    """The child's reply line, or None when it wrote none before the deadline or exit."""
    data = b""
    while b"\n" not in data and len(data) < MAX_REPLY_BYTES:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([read_fd], [], [], left)[0]:
            return None
        chunk = os.read(read_fd, 1 << 16)
        if not chunk:
            return None
        data += chunk
    return data.split(b"\n", 1)[0]


def _parse(line: bytes | None) -> dict[str, Any]:
    try:
        reply = json.loads(line) if line is not None else None
    except ValueError:
        reply = None
    if not isinstance(reply, dict) or not ({"reward", "raised"} & reply.keys()):
        return {"died": "the scorer ended without a verdict"}
    if "reward" in reply and not isinstance(reply["reward"], int | float):
        return {"died": "the scorer's verdict is not a number"}
    return reply


def grade_in_child(grader: Any, item: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Fork, score ``item`` in the child under ``timeout_s``, reap it; the reply."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _child(grader, item, write_fd)
    os.close(write_fd)
    try:
        reply = _parse(_read_reply(read_fd, time.monotonic() + timeout_s))
    finally:
        os.close(read_fd)
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
    return reply


def _send(fd: int, message: dict[str, Any]) -> None:
    data = json.dumps(message, default=str).encode() + b"\n"
    while data:
        data = data[os.write(fd, data) :]


def _lines(fd: int):
    buffer = b""
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            yield json.loads(line)


def _load_grader(name: str) -> Any:
    from relayrl.plugins import load_plugins_from_env
    from relayrl.rewards.dispatch import GRADERS

    load_plugins_from_env()
    grader = GRADERS.get(name)
    if grader is None:
        raise LookupError(f"unknown grader {name!r} in the isolated grading process")
    return grader


def _not_dumpable() -> None:
    """No process of the sandbox's uid (a scoring child) may trace this one or read its
    memory (``PR_SET_DUMPABLE`` 0)."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def main() -> None:
    _not_dumpable()
    config = json.loads(sys.argv[1])
    sys.path[:0] = config["path"]
    request_fd, reply_fd = int(config["request_fd"]), int(config["reply_fd"])
    try:
        grader = _load_grader(config["grader"])
    except Exception as exc:  # noqa: BLE001 - reported to the host, which stops the run
        _send(reply_fd, {"fatal": f"{type(exc).__name__}: {exc}"[:500]})
        return
    _send(reply_fd, {"ready": True})
    warm = getattr(grader, "warm", None)  # trusted set-up from the problem alone
    for item in _lines(request_fd):
        if warm is not None:
            try:
                warm(_problem(item))
            except Exception as exc:  # noqa: BLE001 - the grader cannot run here at all
                _send(reply_fd, {"i": item["i"], "fatal": f"{type(exc).__name__}: {exc}"[:500]})
                return
        reply = grade_in_child(grader, item, float(config["item_timeout_s"]))
        _send(reply_fd, {"i": item["i"], **reply})


if __name__ == "__main__":
    main()
