"""``relayrl bench http``: the rollout client's HTTP transport, ours (``engine/http.py``)
against aiohttp and httpx, on the traffic an asynchronous run makes.

A loopback server in a child process answers ``POST /generate`` after a delay drawn from an
exponential distribution (mean ``--latency-ms``, generation time) with a JSON body the size
of a batched generation result. The client keeps ``--in-flight`` requests open at once (the
(η + 1)·B·n of an asynchronous run; 320 at η = 4, B = n = 8) until ``--requests`` are done.
Measured per transport, in this one process: CPU seconds of the client per request
(``time.process_time``: the GIL time an event loop takes from the trainer thread beside it,
docs/async.md) and wall seconds. The transports run in turn, twice each, in one run, and
the best of each is kept; the last line is ``aiohttp_vs_ours_cpu_per_request=X.XX`` (> 1:
aiohttp costs more client CPU per request; aiohttp comes with ``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import multiprocessing
import random
import socket
import time
from collections.abc import Awaitable, Callable

HELP = "rollout-client HTTP transport: ours vs aiohttp vs httpx at many requests in flight"
BODY_TOKENS = 80 * 8  # a group of 8 samples of 80 tokens: ids, logprobs, versions


def _serve(port: int, latency_s: float, ready: multiprocessing.Event) -> None:
    """A keep-alive HTTP/1.1 server on loopback (asyncio streams, no framework cost)."""
    body = json.dumps(
        {
            "output_ids": list(range(BODY_TOKENS)),
            "output_logprobs": [-0.123456] * BODY_TOKENS,
            "output_versions": [3] * BODY_TOKENS,
        }
    ).encode()
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
    )
    rng = random.Random(0)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                headers = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in headers.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                await reader.readexactly(length)
                await asyncio.sleep(rng.expovariate(1 / latency_s))
                writer.write(head + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
        ready.set()
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


Send = Callable[[dict], Awaitable[dict]]


async def _drive(send: Send, requests: int, in_flight: int) -> tuple[float, float]:
    """(client CPU seconds, wall seconds) for ``requests`` calls, ``in_flight`` at a time."""
    payload = {"input_ids": [list(range(40))] * 8, "sampling_params": {"max_new_tokens": 80}}
    left = requests

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            reply = await send(payload)
            assert len(reply["output_ids"]) == BODY_TOKENS

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return time.process_time() - cpu, time.perf_counter() - wall


async def _ours(url: str, requests: int, in_flight: int) -> tuple[float, float]:
    from relayrl.engine.http import FastHTTP

    http = FastHTTP({}, 60.0, 5.0, in_flight)

    async def send(payload: dict) -> dict:
        status, body = await http.request("POST", url, "/generate", payload)
        return json.loads(body)

    try:
        return await _drive(send, requests, in_flight)
    finally:
        await http.aclose()


async def _aiohttp(url: str, requests: int, in_flight: int) -> tuple[float, float]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=in_flight)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def send(payload: dict) -> dict:
            async with session.post(url + "/generate", json=payload) as response:
                return json.loads(await response.read())

        return await _drive(send, requests, in_flight)


async def _httpx(url: str, requests: int, in_flight: int) -> tuple[float, float]:
    import httpx

    limits = httpx.Limits(max_connections=in_flight)
    async with httpx.AsyncClient(limits=limits, timeout=60.0) as client:

        async def send(payload: dict) -> dict:
            response = await client.post(url + "/generate", json=payload)
            return json.loads(response.content)

        return await _drive(send, requests, in_flight)


TRANSPORTS = {"ours": _ours, "aiohttp": _aiohttp, "httpx": _httpx}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a smoke run under a minute")
    parser.add_argument("--requests", type=int, default=6000, help="requests per transport run")
    parser.add_argument("--trials", type=int, default=2, help="runs per transport (best kept)")
    parser.add_argument("--in-flight", type=int, default=320, help="concurrent requests")
    parser.add_argument("--latency-ms", type=float, default=50.0, help="mean server delay")
    parser.add_argument(
        "--transports", default="ours,aiohttp,httpx", help="comma list of ours,aiohttp,httpx"
    )


def run(args: argparse.Namespace) -> int:
    names = [t.strip() for t in args.transports.split(",") if t.strip()]
    unknown = sorted(set(names) - set(TRANSPORTS))
    if unknown or "ours" not in names:
        raise SystemExit(
            f"error: --transports takes ours (required), aiohttp, httpx; unknown: {unknown}"
        )
    if "aiohttp" in names and importlib.util.find_spec("aiohttp") is None:
        raise SystemExit("error: the aiohttp side needs aiohttp: pip install -e '.[bench]'")
    requests = 1200 if args.quick else args.requests
    port = _free_port()
    ready = multiprocessing.get_context("spawn").Event()
    server = multiprocessing.get_context("spawn").Process(
        target=_serve, args=(port, args.latency_ms / 1000, ready), daemon=True
    )
    server.start()
    try:
        if not ready.wait(30):
            raise SystemExit("error: the loopback server did not start within 30 s")
        url = f"http://127.0.0.1:{port}"
        best: dict[str, tuple[float, float]] = {}
        for trial in range(args.trials):
            for name in names:
                cpu, wall = asyncio.run(TRANSPORTS[name](url, requests, args.in_flight))
                print(
                    f"{name}: trial={trial} requests={requests} in_flight={args.in_flight} "
                    f"cpu_ms_per_request={1000 * cpu / requests:.3f} "
                    f"requests_per_s={requests / wall:.0f}",
                    flush=True,
                )
                if name not in best or cpu < best[name][0]:
                    best[name] = (cpu, wall)
    finally:
        server.kill()
    for name, (cpu, _wall) in best.items():
        print(f"best_{name}_cpu_ms_per_request={1000 * cpu / requests:.3f}")
    if args.quick:
        print("note: --quick is a smoke test (1200 requests); use the default for figures")
    other = "aiohttp" if "aiohttp" in best else next((n for n in best if n != "ours"), "ours")
    print(f"{other}_vs_ours_cpu_per_request={best[other][0] / best['ours'][0]:.2f}")
    return 0
