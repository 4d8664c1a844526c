"""Admission limits of the rollout server's HTTP layer (docs/security.md): how large a body
and how slow a client may be before the server stops waiting for it.

Owns: :class:`BodyLimitMiddleware` (a body over :data:`MAX_BODY_BYTES`, announced or
streamed, is a 413 before the app parses it) and :class:`DeadlineH11Protocol` (uvicorn's
h11 protocol with read deadlines: the headers of a request must be complete within
:data:`HEADER_TIMEOUT_S` of the connection being ready for it, its body within
:data:`BODY_TIMEOUT_S` of its headers, or the connection is closed). uvicorn alone waits for
ever on a connection that sends part of its headers (its keep-alive timer only runs between
requests), so 50 slow connections held 50 sockets and their buffers indefinitely; h11 caps
the size of incomplete headers (16 KiB), this caps their time. And
:func:`await_or_disconnect`: a request's generation is cancelled (its engine requests
aborted) as soon as its client goes away.

Imports: uvicorn, h11 and starlette (the server's HTTP stack), the standard library.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from starlette.requests import Request
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_BODY_BYTES = 64 * 2**20  # a batched /generate of 512 prompts x 4096 tokens is ~12 MiB
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 60.0


async def _reject(send: Any, status: int, message: str) -> None:
    body = json.dumps({"error": message, "success": False}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    """Pure ASGI middleware: 413 for a request body over ``max_bytes``."""

    def __init__(self, app: Any, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        too_big = f"body: over {self.max_bytes} bytes"
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await _reject(send, 413, too_big)
            return
        seen = 0
        started = False

        async def counted_receive() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
            return message

        async def tracked_send(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _TooLarge:
            if not started:
                await _reject(send, 413, too_big)


class _TooLarge(Exception):
    """A streamed (chunked) body passed the limit."""


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with header and body read deadlines; see the module
    docstring. Pass it as ``uvicorn.Config(http=DeadlineH11Protocol)``."""

    header_timeout_s = HEADER_TIMEOUT_S
    body_timeout_s = BODY_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._read_phase: str | None = None
        self._read_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._follow_read_phase()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_read_phase()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_read_phase()  # the next request's headers (after keep-alive's wait)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_timer()
        super().connection_lost(exc)

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _follow_read_phase(self) -> None:
        """Arm the deadline of what the client is sending now (headers or body), or none."""
        state = self.conn.their_state
        phase = "headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        if phase == self._read_phase:
            return
        self._cancel_read_timer()
        self._read_phase = phase
        if phase is not None:
            limit = self.header_timeout_s if phase == "headers" else self.body_timeout_s
            self._read_timer = self.loop.call_later(limit, self._read_expired, phase)

    def _read_expired(self, phase: str) -> None:
        self._read_timer = None
        if self._read_phase != phase or self.transport.is_closing():
            return
        if phase == "headers" and self.cycle is not None and not self.cycle.response_complete:
            return  # a response is still being produced (pipelining): not the client's delay
        self.logger.debug("closing a connection: its request %s took too long", phase)
        self.transport.close()


async def until_disconnect(request: Request) -> None:
    """Return when the client closes its connection (the ASGI ``http.disconnect`` message).

    Once the body is read, the server's next ``receive`` waits for exactly that; an event,
    where polling ``is_disconnected`` would wake every request in flight on a timer.
    """
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def await_or_disconnect(request: Request, task: asyncio.Future) -> bool:
    """Wait for ``task``; cancel it and return False if the client goes away first."""
    watcher = asyncio.ensure_future(until_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return True
    task.cancel()
    # a cancelled gather ends with CancelledError as its exception: read it, or asyncio
    # logs "exception was never retrieved" for every disconnected request
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return False
