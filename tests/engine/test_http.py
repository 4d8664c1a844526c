"""FastHTTP, the rollout client's transport: keep-alive reuse, chunked bodies, a stale
keep-alive connection retried once, connection errors, cancellation closes the socket."""

from __future__ import annotations

import asyncio
import json

import pytest

from relayrl.engine.http import ConnectError, FastHTTP


async def _serve(handler):
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, dict]:
    line = (await reader.readline()).decode()
    if not line:
        raise EOFError
    length = 0
    while (h := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = h.decode().partition(":")
        if name.lower() == "content-length":
            length = int(value)
    body = json.loads(await reader.readexactly(length)) if length else None
    return line.split()[1], body


def _answer(payload: dict, chunked: bool = False, close: bool = False) -> bytes:
    data = json.dumps(payload).encode()
    head = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
    if close:
        head += "Connection: close\r\n"
    if chunked:
        half = len(data) // 2
        body = b"".join(
            f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in (data[:half], data[half:])
        )
        return (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + body + b"0\r\n\r\n"
    return (head + f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def test_keep_alive_chunked_close_and_stale_connections():
    async def scenario():
        served = []

        async def handler(reader, writer):
            while True:
                try:
                    path, body = await _read_request(reader)
                except (EOFError, ConnectionError):
                    break
                served.append(path)
                if path == "/chunked":
                    writer.write(_answer({"echo": body}, chunked=True))
                elif path == "/close":
                    writer.write(_answer({"bye": 1}, close=True))
                elif path == "/drop":  # answers, then silently drops the keep-alive socket
                    writer.write(_answer({"dropped": 1}))
                    await writer.drain()
                    break
                else:
                    writer.write(_answer({"path": path, "echo": body}))
                await writer.drain()
            writer.close()

        server, url = await _serve(handler)
        http = FastHTTP(headers={"Authorization": "Bearer k"})
        for i in range(3):
            status, data = await http.request("POST", url, "/generate", {"i": i})
            assert status == 200 and json.loads(data) == {"path": "/generate", "echo": {"i": i}}
        assert http.opened == 1  # one keep-alive connection for sequential requests
        status, data = await http.request("POST", url, "/chunked", {"x": [1, 2, 3]})
        assert json.loads(data) == {"echo": {"x": [1, 2, 3]}}
        await http.request("GET", url, "/close")
        await http.request("GET", url, "/health")
        assert http.opened == 2  # "Connection: close" was honoured
        await http.request("GET", url, "/drop")
        await asyncio.sleep(0.05)  # the server has closed the idle connection
        status, data = await http.request("GET", url, "/after-drop")
        assert status == 200 and json.loads(data)["path"] == "/after-drop"
        many = await asyncio.gather(*(http.request("POST", url, "/p", {"j": j}) for j in range(50)))
        assert [json.loads(d)["echo"]["j"] for _, d in many] == list(range(50))
        await http.aclose()
        server.close()
        await server.wait_closed()

    asyncio.run(scenario())


def test_connect_error_and_cancel_closes_the_connection():
    async def scenario():
        with pytest.raises(ConnectError, match="127.0.0.1:9"):
            await FastHTTP(connect_timeout=1.0).request("GET", "http://127.0.0.1:9", "/health")

        saw_eof = asyncio.Event()

        async def handler(reader, writer):
            await _read_request(reader)
            await reader.read()  # never answers; returns at the client's disconnect
            saw_eof.set()
            writer.close()

        server, url = await _serve(handler)
        http = FastHTTP(timeout=0.2)
        with pytest.raises(asyncio.TimeoutError):
            await http.request("POST", url, "/generate", {"x": 1})
        await asyncio.wait_for(saw_eof.wait(), 5.0)
        assert not any(http._idle.values())  # the timed-out connection was not pooled
        server.close()
        await server.wait_closed()

    asyncio.run(scenario())


def test_control_requests_do_not_wait_behind_generation_on_a_paused_server():
    """Issue 35: a vLLM publication hung because the generation requests held every pooled
    connection of the client while the server was paused (it answers them only after
    /resume), so the load and the resume waited for a connection forever. Here the pool is
    4 connections, 4 generations wait on a paused server, and pause/load/resume still go
    through; the generations then finish."""
    from relayrl.engine.client import RolloutClient

    async def scenario():
        resumed = asyncio.Event()
        served = []

        async def handler(reader, writer):
            while True:
                try:
                    path, _ = await _read_request(reader)
                except (EOFError, ConnectionError, asyncio.IncompleteReadError):
                    break
                served.append(path)
                if path == "/generate":
                    await resumed.wait()  # a paused server holds generation requests
                    payload = {"output_ids": [1], "meta_info": {"finish_reason": "stop"}}
                elif path == "/continue_generation":
                    resumed.set()
                    payload = {"ok": True}
                else:
                    payload = {"ok": True}
                writer.write(_answer(payload))
                await writer.drain()
            writer.close()

        server, url = await _serve(handler)
        async with server:
            client = RolloutClient(url, max_connections=4, timeout=30.0)
            await client.pause("in_place")
            gens = [asyncio.ensure_future(client.generate([1, 2], {"seed": i})) for i in range(4)]
            while served.count("/generate") < 4:
                await asyncio.sleep(0.01)
            # the pool is full of waiting generations: the control calls must not queue
            await asyncio.wait_for(client.update_weights("/nowhere", version=1), 5.0)
            await asyncio.wait_for(client.continue_generation(), 5.0)
            outs = await asyncio.wait_for(asyncio.gather(*gens), 5.0)
            await client.close()
        assert [o.output_ids for o in outs] == [[1]] * 4

    asyncio.run(scenario())


def test_waiting_for_a_free_connection_counts_against_the_deadline():
    """FastHTTP's deadline covers the wait for one of its ``max_connections`` slots."""

    async def scenario():
        release = asyncio.Event()

        async def handler(reader, writer):
            try:
                await _read_request(reader)
            except (EOFError, ConnectionError):
                return
            await release.wait()
            writer.write(_answer({"ok": True}))
            await writer.drain()
            writer.close()

        server, url = await _serve(handler)
        async with server:
            http = FastHTTP(timeout=0.5, max_connections=1)
            first = asyncio.ensure_future(http.request("GET", url, "/a"))
            await asyncio.sleep(0.05)
            with pytest.raises(asyncio.TimeoutError):
                await http.request("GET", url, "/b")  # no slot within 0.5 s
            release.set()
            with pytest.raises(asyncio.TimeoutError):
                await first  # it waited past the deadline too
            await http.aclose()

    asyncio.run(scenario())
