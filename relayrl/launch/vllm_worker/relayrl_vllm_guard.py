"""The authenticating layer in front of a vLLM server that relayrl launches (docs/security.md).

vLLM's own ``--api-key`` (``VLLM_API_KEY``) guards only ``/v1``, ``/v2``, ``/inference`` and
``/cohere``; the RL endpoints that ``VLLM_SERVER_DEV_MODE=1`` adds (``/pause``,
``/collective_rpc``, ``/update_weight_version``, ``/sleep``, ...) stay open, and
``/collective_rpc`` calls any worker method by name. The launcher therefore passes
``--middleware relayrl_vllm_guard.RelayGuard`` (this directory is on the server's
``PYTHONPATH``), the outermost layer of the app, which:

* answers every request but ``GET``/``HEAD`` of :data:`OPEN_PATHS` with 401 unless it carries
  ``Authorization: Bearer <key>``, the key read from ``RELAYRL_API_KEY`` at start (a server
  started with no key refuses every such request: dev mode is never left open);
* lets ``/collective_rpc`` call only relayrl's extension methods (:data:`RPC_METHODS`,
  403 otherwise), checked on the request body before vLLM sees it;
* answers a ``GET /health`` that carries a challenge (``x-relayrl-challenge``) with the proof
  that it holds the key (``x-relayrl-proof``, :func:`health_proof`, the same as
  ``relayrl.runkey.health_proof``), so the launcher tells its server from a process squatting
  its port without sending the key.

Runs inside vLLM's environment: the standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable
from typing import Any

OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})
RPC_METHODS = frozenset(
    {
        "relayrl_load_weights",
        "relayrl_join_group",
        "relayrl_receive_weights",
        "relayrl_leave_group",
        "relayrl_base_adapter",
        "relayrl_lora_setup",
    }
)
MAX_RPC_BODY = 1 << 20  # a collective_rpc body of relayrl's is a few KiB

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


CHALLENGE_HEADER = b"x-relayrl-challenge"
PROOF_HEADER = b"x-relayrl-proof"
MAX_CHALLENGE = 128


def health_proof(key: str, port: int, challenge: str) -> str:
    """``relayrl.runkey.health_proof`` (this module cannot import relayrl)."""
    message = f"relayrl-health {int(port)} {challenge}"
    return hmac.new(key.encode(), message.encode(), hashlib.sha256).hexdigest()


def _proving(send: Send, key: str, scope: Scope) -> Send:
    """``send`` with the proof for the request's challenge in the response headers."""
    raw = dict(scope.get("headers") or []).get(CHALLENGE_HEADER, b"")
    if not key or not raw or len(raw) > MAX_CHALLENGE:
        return send
    port = (scope.get("server") or ("", 0))[1] or 0
    proof = health_proof(key, port, raw.decode("latin-1")).encode()

    async def proving_send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (PROOF_HEADER, proof)]}
        await send(message)

    return proving_send


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


async def _answer(send: Send, status: int, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _read_body(receive: Receive, limit: int) -> tuple[bytes | None, list[dict[str, Any]]]:
    """The request body (None past ``limit`` bytes) and the messages it came in, to replay."""
    messages, size, chunks = [], 0, []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return b"".join(chunks), messages
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None, messages
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), messages


def _rpc_method(body: bytes) -> str | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    method = data.get("method") if isinstance(data, dict) else None
    return method if isinstance(method, str) else None


class RelayGuard:
    """Pure ASGI middleware; see the module docstring."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app
        key = os.environ.get("RELAYRL_API_KEY") or os.environ.get("VLLM_API_KEY") or ""
        self.key = key
        self.expected = _digest(key) if key else None

    def _authorized(self, scope: Scope) -> bool:
        if self.expected is None:
            return False
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(_digest(token), self.expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "").removeprefix(scope.get("root_path", "")) or "/"
        if scope.get("method") in ("GET", "HEAD") and path in OPEN_PATHS:
            await self.app(scope, receive, _proving(send, self.key, scope))
            return
        if not self._authorized(scope):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            await _answer(send, 401, "missing or wrong API key (Authorization: Bearer <key>)")
            return
        if path.rstrip("/") == "/collective_rpc":
            body, messages = await _read_body(receive, MAX_RPC_BODY)
            if body is None:
                await _answer(send, 413, f"collective_rpc body over {MAX_RPC_BODY} bytes")
                return
            method = _rpc_method(body)
            if method not in RPC_METHODS:
                await _answer(
                    send, 403, f"method: {method!r} is not one of relayrl's {sorted(RPC_METHODS)}"
                )
                return
            receive = _replay(messages, receive)
        await self.app(scope, receive, send)


def _replay(messages: list[dict[str, Any]], receive: Receive) -> Receive:
    """A ``receive`` that hands out ``messages`` again, then defers to the real one."""
    pending = list(messages)

    async def replayed() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
