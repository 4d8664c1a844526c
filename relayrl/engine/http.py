"""A minimal asyncio HTTP/1.1 JSON client with per-origin keep-alive, O(1) per request.

Owns: :class:`FastHTTP`, used by :class:`relayrl.engine.client.RolloutClient` for plain
``http://`` servers. Why not httpx: its connection pool (httpcore 1.x) re-scans every
connection, and for every idle one every connection again, each time a request starts or a
response is closed: O(connections²) Python work per request. With the (η + 1)·B·n requests
an asynchronous run keeps in flight (320 at η = 4, B = n = 8) that bookkeeping held the
GIL ~90% of the time in the trainer process and made the trainer step 4× slower
(docs/async.md, "Measured"). Here a request takes an idle connection from a per-origin list
(or opens one), writes one buffer, reads the status line, headers and a Content-Length or
chunked body, and puts the connection back unless the server asked to close it.

Errors: connecting raises :class:`ConnectError` (an ``OSError``), a timeout (the wait for one
of the ``max_connections`` slots included) ``asyncio.TimeoutError``; a reused keep-alive connection that the server had closed is
retried once on a fresh connection (the request was never read). A cancelled request closes
its connection, so the server sees the disconnect.

Imports: the standard library only.
"""

from __future__ import annotations

import asyncio
import json as jsonlib
from typing import Any
from urllib.parse import urlsplit


class ConnectError(OSError):
    """The server could not be reached (refused, unresolvable, connect timeout)."""


class _StaleConnection(Exception):
    """A reused connection was closed by the server before answering."""


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def header_lines(headers: dict[str, str]) -> str:
    """``headers`` as HTTP/1.1 header lines (``Name: value\\r\\n`` each)."""
    return "".join(f"{k}: {v}\r\n" for k, v in headers.items())


class FastHTTP:
    """``await http.request("POST", "http://host:port", "/path", json)`` → (status, body)."""

    def __init__(
        self,
        headers: dict[str, str] | None = None,
        timeout: float = 600.0,
        connect_timeout: float = 5.0,
        max_connections: int = 256,
        max_idle: int = 256,
    ) -> None:
        self.headers = header_lines(headers or {})
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self._max_connections = max_connections
        self._slots: asyncio.Semaphore | None = None
        self._idle: dict[tuple[str, int], list[Connection]] = {}
        self.opened = 0  # connections opened (tests: keep-alive reuses them)

    @staticmethod
    def supports(url: str) -> bool:
        return urlsplit(url).scheme == "http"

    async def request(
        self, method: str, url: str, path: str, json: Any = None, headers: str = ""
    ) -> tuple[int, bytes]:
        """One exchange; ``headers``: this request's own header lines (``Name: value\\r\\n``
        each, see :func:`header_lines`), sent after the client's."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._max_connections)
        parts = urlsplit(url)
        origin = (parts.hostname or "127.0.0.1", parts.port or 80)
        body = b"" if json is None else jsonlib.dumps(json, separators=(",", ":")).encode()
        head = (
            f"{method} {parts.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {origin[0]}:{origin[1]}"
            f"\r\n{self.headers}{headers}Accept: application/json\r\n"
        )
        if json is not None or method != "GET":
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        message = head.encode() + b"\r\n" + body
        # the wait for a free connection counts against the deadline too
        return await asyncio.wait_for(self._slotted(origin, message), self.timeout)

    async def _slotted(self, origin: tuple[str, int], message: bytes) -> tuple[int, bytes]:
        assert self._slots is not None
        async with self._slots:
            return await self._exchange(origin, message)

    async def _exchange(self, origin: tuple[str, int], message: bytes) -> tuple[int, bytes]:
        idle = self._idle.setdefault(origin, [])
        while idle:
            conn = idle.pop()
            if conn[0].at_eof() or conn[1].is_closing():
                conn[1].close()
                continue
            try:
                return await self._on(conn, origin, message, reused=True)
            except _StaleConnection:
                break
        conn = await self._connect(origin)
        return await self._on(conn, origin, message, reused=False)

    async def _connect(self, origin: tuple[str, int]) -> Connection:
        try:
            conn = await asyncio.wait_for(
                asyncio.open_connection(*origin), timeout=self.connect_timeout
            )
        except (OSError, asyncio.TimeoutError) as exc:
            raise ConnectError(f"cannot connect to {origin[0]}:{origin[1]}: {exc!r}") from exc
        self.opened += 1
        return conn

    async def _on(
        self, conn: Connection, origin: tuple[str, int], message: bytes, reused: bool
    ) -> tuple[int, bytes]:
        reader, writer = conn
        keep = False
        try:
            try:
                writer.write(message)
                await writer.drain()
                status_line = await reader.readline()
            except (ConnectionError, asyncio.IncompleteReadError) as exc:
                if reused:
                    raise _StaleConnection from exc
                raise
            if not status_line:
                if reused:
                    raise _StaleConnection
                raise ConnectionResetError("server closed the connection without answering")
            status = int(status_line.split(None, 2)[1])
            length, chunked, keep = None, False, True
            while True:
                line = await reader.readline()
                if line in (b"\r\n", b"\n", b""):
                    break
                name, _, value = line.decode("latin-1").partition(":")
                name, value = name.strip().lower(), value.strip().lower()
                if name == "content-length":
                    length = int(value)
                elif name == "transfer-encoding" and "chunked" in value:
                    chunked = True
                elif name == "connection" and value == "close":
                    keep = False
            if chunked:
                data = await _read_chunked(reader)
            elif length is not None:
                data = await reader.readexactly(length)
            else:
                data, keep = await reader.read(), False
            return status, data
        except BaseException:
            keep = False
            raise
        finally:
            idle = self._idle.setdefault(origin, [])
            if keep and len(idle) < self.max_idle:
                idle.append(conn)
            else:
                writer.close()

    async def aclose(self) -> None:
        conns = [c for idle in self._idle.values() for c in idle]
        self._idle.clear()
        for _, writer in conns:
            writer.close()
        for _, writer in conns:
            try:
                await writer.wait_closed()
            except OSError:
                pass


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    out = bytearray()
    while True:
        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return bytes(out)
        out += await reader.readexactly(size)
        await reader.readexactly(2)
