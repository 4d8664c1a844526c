"""Candidate side of the code-grading protocol, and the value codec both sides share.

Run inside the sandbox as ``python -I _code_runner.py PROGRAM REQ_FD RESP_FD ENTRY_POINT``
(standard library only; it must not import relayrl). It executes the candidate program,
then answers calls: each request line is ``{"args": [...], "n": NONCE}`` (encoded values), each
reply one line ``{"n": NONCE, "ok": value}``, ``{"n": NONCE, "raised": "ExcName"}`` or
``{"n": NONCE, "unsupported": "TypeName"}`` (the nonce echoed from the request).

The codec carries only plain data — None, bool, int, float (also nan/inf), str, bytes,
complex, list, tuple, dict, set, frozenset — with exact types, so no object with a custom
``__eq__`` can cross into the trusted test process.
"""

from __future__ import annotations

import json
import os
import sys

MAX_DEPTH = 50
MAX_LINE_BYTES = 8 << 20


def encode(value: object, depth: int = 0) -> object:
    """A JSON-compatible, type-tagged form of a plain-data value (TypeError otherwise)."""
    if depth > MAX_DEPTH:
        raise TypeError("nested too deeply")
    kind = type(value)
    if value is None or kind in (bool, str):
        return value
    if kind is int:
        return {"i": str(value)}
    if kind is float:
        return {"f": repr(value)}
    if kind is list:
        return [encode(v, depth + 1) for v in value]
    if kind is tuple:
        return {"t": [encode(v, depth + 1) for v in value]}
    if kind is dict:
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind is set or kind is frozenset:
        tag = "s" if kind is set else "fs"
        return {tag: [encode(v, depth + 1) for v in value]}
    if kind is bytes:
        return {"b": value.hex()}
    if kind is complex:
        return {"c": [repr(value.real), repr(value.imag)]}
    raise TypeError(kind.__name__)


def decode(data: object) -> object:
    """The inverse of :func:`encode`; anything malformed raises ValueError."""
    if data is None or isinstance(data, (bool, str)):
        return data
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict) or len(data) != 1:
        raise ValueError("malformed value")
    ((tag, body),) = data.items()
    if tag == "i":
        return int(body)
    if tag == "f":
        return float(body)
    if tag == "t":
        return tuple(decode(v) for v in body)
    if tag == "d":
        return {decode(k): decode(v) for k, v in body}
    if tag == "s":
        return {decode(v) for v in body}
    if tag == "fs":
        return frozenset(decode(v) for v in body)
    if tag == "b":
        return bytes.fromhex(body)
    if tag == "c":
        return complex(float(body[0]), float(body[1]))
    raise ValueError(f"unknown tag {tag!r}")


def _install_socket_guard() -> None:
    """Fallback when no network namespace could be made: refuse sockets via an audit hook."""

    def hook(event: str, args: tuple) -> None:
        if event.startswith("socket.") or event in ("ctypes.dlopen", "ctypes.dlsym"):
            raise PermissionError(f"sandbox: {event} is not allowed")

    sys.addaudithook(hook)


def _send(out, message: dict) -> None:
    out.write(json.dumps(message).encode() + b"\n")
    out.flush()


def main() -> None:
    program, req_fd, resp_fd, entry = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    requests = os.fdopen(req_fd, "rb")
    replies = os.fdopen(resp_fd, "wb")
    if os.environ.get("RELAYRL_SANDBOX_NET") != "namespace":
        _install_socket_guard()
    with open(program, encoding="utf-8") as handle:
        source = handle.read()
    namespace = {"__name__": "__candidate__"}
    try:
        exec(compile(source, program, "exec"), namespace)
        function = namespace[entry]
    except BaseException as exc:  # the candidate's fault: report and stop
        _send(replies, {"load_error": type(exc).__name__})
        return
    _send(replies, {"ready": True})
    while True:
        line = requests.readline(MAX_LINE_BYTES)
        if not line:
            return
        request = json.loads(line)
        args, nonce = decode(request["args"]), request["n"]
        try:
            result = function(*args)
        except BaseException as exc:
            _send(replies, {"n": nonce, "raised": type(exc).__name__})
            continue
        try:
            reply = {"n": nonce, "ok": encode(result)}
        except (TypeError, ValueError, RecursionError) as exc:
            reply = {"n": nonce, "unsupported": str(exc)[:100]}
        _send(replies, reply)


if __name__ == "__main__":
    main()
