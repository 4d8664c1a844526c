"""Admission on a real loopback server (docs/security.md): out-of-range sampling fields are
a 400 naming the field and fail alone, never the requests sharing their engine step; a
transfer-group deadline past any timedelta is a 400 before the joined group is touched;
bodies are capped; a client that sends part of its headers or body is cut off within the
read deadlines (raw sockets, as a slowloris client)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from relayrl.engine.limits import DeadlineH11Protocol
from relayrl.engine.server import ServerThread, create_app


@pytest.fixture
def server(make_engine):
    engine = make_engine(max_running_requests=32)
    app = create_app(engine)
    thread = ServerThread(app).start()
    yield thread, app, engine
    thread.stop()


def test_one_out_of_range_request_fails_alone_among_twelve_concurrent_groups(server):
    """The repro: one request with top_k >= 2**63 among 12 concurrent groups failed every
    request of the engine step (the batch's top_k tensor overflowed)."""
    thread, _, _ = server

    def group(i: int) -> dict:
        params = {"max_new_tokens": 4, "temperature": 1.0, "seed": i, "ignore_eos": True}
        if i == 5:
            params["top_k"] = 2**63
        return {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": params}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=thread.url, timeout=120) as client:
            return await asyncio.gather(
                *(client.post("/generate", json=group(i)) for i in range(12))
            )

    answers = asyncio.run(burst())
    assert answers[5].status_code == 400 and "top_k" in answers[5].json()["error"]
    for i, answer in enumerate(answers):
        if i != 5:
            assert answer.status_code == 200, (i, answer.text)
            assert [len(r["output_ids"]) for r in answer.json()] == [4, 4]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", 2**63),
        ("top_k", -2),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", 1e-310),  # denormal: logits / T overflow
        ("top_p", float("nan")),
        ("top_p", 1e-310),
        ("max_new_tokens", 2**40),
        ("stop", ["x"] * 65),
        ("stop", ["x" * 1025]),
        ("stop_token_ids", [2**63]),
    ],
)
def test_out_of_range_sampling_fields_are_a_400_naming_the_field(server, field, value):
    thread, _, engine = server
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, field: value}}
    answer = httpx.post(
        thread.url + "/generate",
        content=json.dumps(body),  # NaN / Infinity as Python's json writes them
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert answer.status_code == 400, answer.text
    assert field in answer.json()["error"]
    ok = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    assert httpx.post(thread.url + "/generate", json=ok, timeout=60).status_code == 200


class Joined:
    name = "current"
    closed = False

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("timeout_s", [1e300, float("inf"), 86401.0])
def test_an_unbounded_group_deadline_is_a_400_before_the_group_is_left(server, timeout_s):
    thread, app, _ = server
    joined = app.state.transfer = Joined()
    body = {
        "master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1,
        "world_size": 2, "group_name": "g", "timeout_s": timeout_s,
    }  # fmt: skip
    answer = httpx.post(
        thread.url + "/init_weights_update_group",
        content=json.dumps(body),
        headers={"content-type": "application/json"},
    )
    assert answer.status_code == 400 and "timeout_s" in answer.json()["error"]
    assert app.state.transfer is joined and not joined.closed


def raw(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def closed_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the server closes ``sock`` (reading what it sends meanwhile)."""
    start = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        pytest.fail(f"the server kept the connection open over {seconds} s")
    except ConnectionResetError:
        pass
    return time.monotonic() - start


def test_a_body_over_the_cap_is_a_413_before_it_is_read(server):
    thread, _, _ = server
    with raw(thread.url) as sock:
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 999999999\r\n\r\n{"
        )
        sock.settimeout(10)
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")


def test_slowloris_headers_and_bodies_are_cut_off(server, monkeypatch):
    """50 connections with partial headers and one with a partial body: all closed within
    the (shortened) deadlines, and the server still answers."""
    monkeypatch.setattr(DeadlineH11Protocol, "header_timeout_s", 1.0)
    monkeypatch.setattr(DeadlineH11Protocol, "body_timeout_s", 1.5)
    thread, _, _ = server
    slow = [raw(thread.url) for _ in range(50)]
    for sock in slow:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    silent = raw(thread.url)  # connects and sends nothing at all
    body = raw(thread.url)
    body.sendall(
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"input_ids": '
    )
    try:
        assert max(closed_within(s, 10) for s in [*slow, silent]) < 10
        assert closed_within(body, 10) < 10
    finally:
        for sock in [*slow, silent, body]:
            sock.close()
    assert httpx.get(thread.url + "/health").status_code == 200


def test_a_request_that_keeps_sending_is_not_cut_off_by_the_header_deadline(server, monkeypatch):
    """The deadline is on the whole header block, not per byte: a request whose headers
    arrive in pieces within it is served."""
    monkeypatch.setattr(DeadlineH11Protocol, "header_timeout_s", 2.0)
    thread, _, _ = server
    with raw(thread.url) as sock:
        for part in (b"GET /health HTTP/1.1\r\n", b"Host: x\r\n", b"\r\n"):
            sock.sendall(part)
            time.sleep(0.3)
        sock.settimeout(10)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
