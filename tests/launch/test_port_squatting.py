"""Servers that prove who they are (docs/security.md, "Ports nobody can squat"), tried as an
unprivileged neighbour would: a process (``nobody`` when the suite runs as root) reads the
launched servers' ports from ``/proc/*/cmdline`` and binds each one it can, to answer
``GET /health`` and receive the run's ``Authorization: Bearer <key>``. Before, the launcher
chose a port, released it and handed it to a child that bound it only after loading the
model: the squatter got the port, the key and the run's generation requests. Now the child
inherits the socket the launcher bound, the launcher keeps the port until the run ends (also
after its server died), and a launched server is healthy only when it proves it holds the
key (an answer to a challenge, bound to its port), which the client never sends to find out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from relayrl.config.loader import load_config
from relayrl.engine.server import ServerThread, create_app
from relayrl.errors import RelayError
from relayrl.launch.backends import make_backend
from relayrl.launch.servers import ServerLauncher, ServerSpec
from relayrl.launch.vllm import EXTENSION_DIR
from relayrl.runkey import new_key

# named by what they are, so that this module imports where they did not exist yet (the
# squatting test then fails for what it checks, not for an import)
CHALLENGE_HEADER, PROOF_HEADER = "x-relayrl-challenge", "x-relayrl-proof"

NOBODY = 65534
SQUATTER = r"""
import json, os, re, socket, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

if os.getuid() == 0:  # an unprivileged neighbour
    os.setgroups([]); os.setgid(NOBODY); os.setuid(NOBODY)

def say(**event):
    print(json.dumps(event), flush=True)

class Fake(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass
    def do_GET(self):
        self.answer()
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.answer()
    def answer(self):
        say(event="request", path=self.path, authorization=self.headers.get("Authorization"))
        meta = {"finish_reason": {"type": "length"}, "prompt_tokens": 2,
                "output_token_logprobs": [[-0.1, 1, None]] * 3,
                "output_token_versions": [0] * 3, "weight_version": 0}
        body = {"status": "ok", "output_ids": [1, 1, 1], "text": "", "meta_info": meta,
                "max_context_length": 64, "weight_version": 0}
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

def ports():
    found = set()
    for pid in os.listdir("/proc"):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        try:
            status = open(f"/proc/{pid}/status").read()
        except OSError:
            continue
        if f"\nPPid:\t{VICTIM}\n" not in status:  # the test's servers only
            continue
        if any(b"serve_child" in a for a in argv):
            found.update(int(p) for p in re.findall(rb'"port": (\d+)', b" ".join(argv)))
    return found

owned, tried = set(), set()
say(event="ready", uid=os.getuid())
deadline = time.monotonic() + 600
while time.monotonic() < deadline:
    for port in ports() - owned:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            sock.close()
            if port not in tried:
                say(event="bind", port=port, ok=False)
                tried.add(port)
            continue
        owned.add(port)
        say(event="bind", port=port, ok=True)
        server = ThreadingHTTPServer(("127.0.0.1", port), Fake, bind_and_activate=False)
        server.socket.close()
        server.socket = sock
        server.server_activate()
        threading.Thread(target=server.serve_forever, daemon=True).start()
    time.sleep(0.02)
""".replace("NOBODY", str(NOBODY)).replace("VICTIM", str(os.getpid()))


@dataclass
class Squatter:
    """The squatting process and what it reported (JSON lines on its stdout)."""

    proc: subprocess.Popen
    events: queue.Queue

    @classmethod
    def start(cls) -> Squatter:
        proc = subprocess.Popen(
            [sys.executable, "-c", SQUATTER], stdout=subprocess.PIPE, text=True, cwd="/"
        )
        events: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [events.put(json.loads(x)) for x in proc.stdout]).start()
        ready = events.get(timeout=60)
        assert ready["event"] == "ready"
        assert os.getuid() != 0 or ready["uid"] == NOBODY
        return cls(proc, events)

    def stop(self) -> list[dict]:
        self.proc.kill()
        self.proc.wait(timeout=10)
        time.sleep(0.2)  # the reader thread drains the pipe
        return list(self.events.queue)


def builtin_backend(model_dir: Path):
    config = load_config(None, [f"model.path={model_dir}", "model.max_context=64"])
    return make_backend(config, model_dir)


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def generate(backend, urls: list[str]) -> list[int]:
    async with backend.client(urls) as client:
        out = await client.generate([5, 6], {"max_new_tokens": 3, "ignore_eos": True})
        await client.model_info()
        return out.output_ids


def refused_at_once(url: str) -> bool:
    """Whether a connection to ``url`` is refused (within 5 s)."""
    try:
        httpx.get(url + "/health", timeout=5)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    return False


def test_a_port_squatter_never_gets_the_run_key_nor_answers_for_a_server(tiny_model_dir, tmp_path):
    squatter = Squatter.start()
    backend = builtin_backend(tiny_model_dir)
    try:
        with backend.launcher(tmp_path) as launcher:
            first = launcher.urls[0]
            outputs = [asyncio.run(generate(backend, launcher.urls))]
            launcher.kill(0)  # the server dies: its port must stay the run's
            time.sleep(1.0)  # the squatter tries it again meanwhile
            refused = refused_at_once(first)  # as before, not held open by the launcher
            launcher.respawn(0)  # a restart, as the supervisor does it
            launcher.wait_healthy([0])
            outputs.append(asyncio.run(generate(backend, launcher.urls)))
            ports = {port_of(first), port_of(launcher.urls[0])}
    finally:
        events = squatter.stop()
    key = backend.api_key
    seen = [e for e in events if e["event"] == "request"]
    assert not [e for e in seen if key in (e["authorization"] or "")], "the key was stolen"
    assert not seen, f"the squatter was asked {[e['path'] for e in seen]}"
    assert not [e for e in events if e["event"] == "bind" and e["ok"]]
    assert refused
    tried = {e["port"] for e in events if e["event"] == "bind"}
    assert tried == ports  # it saw both ports, bound neither
    assert all(len(ids) == 3 and ids != [1, 1, 1] for ids in outputs)


# a server that the launcher started but that does not hold the key: answers /health only
FAKE_SERVER = r"""
import os, socket, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
fd = os.environ.get("RELAYRL_LISTEN_FD")  # the launcher's socket, else bind the port
server = HTTPServer(("127.0.0.1", int(sys.argv[1])), H, bind_and_activate=not fd)
if fd:
    server.socket = socket.socket(fileno=int(fd))
server.serve_forever()
"""


@dataclass
class KeylessSpec(ServerSpec):
    kind = "keyless stand-in"

    def command(self, port: int) -> list[str]:
        return [sys.executable, "-c", FAKE_SERVER, str(port)]


def test_a_server_that_cannot_prove_the_key_is_never_healthy(tmp_path):
    launcher = ServerLauncher(KeylessSpec("unused", api_key=new_key()), 1, log_dir=tmp_path)
    try:
        with pytest.raises(RelayError, match="without proving that it holds its key"):
            launcher.start()
        assert launcher.pids == []  # stopped
    finally:
        launcher.stop()


class Relay(BaseHTTPRequestHandler):
    """An impostor that passes the challenge on to a real server and copies its proof."""

    target = ""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        challenge = self.headers.get(CHALLENGE_HEADER, "")
        real = httpx.get(self.target + "/health", headers={CHALLENGE_HEADER: challenge})
        self.send_response(real.status_code)
        self.send_header(PROOF_HEADER, real.headers.get(PROOF_HEADER, ""))
        self.send_header("Content-Length", "0")
        self.end_headers()


def test_the_health_proof_is_bound_to_the_key_and_the_port(make_engine_app):
    from relayrl.launch.servers import DOWN, UNPROVEN, UP, health_state

    key = new_key()
    server = ServerThread(make_engine_app(key)).start()
    relay = ThreadingHTTPServer(("127.0.0.1", 0), type("R", (Relay,), {"target": server.url}))
    threading.Thread(target=relay.serve_forever, daemon=True).start()
    url = server.url
    try:
        assert health_state(url, key) == UP
        assert health_state(server.url, new_key()) == UNPROVEN
        relayed = f"http://127.0.0.1:{relay.server_address[1]}"
        assert health_state(relayed, key) == UNPROVEN  # another port's proof is no proof
        answer = httpx.get(server.url + "/health", headers={CHALLENGE_HEADER: "x" * 129})
        assert answer.status_code == 200 and PROOF_HEADER not in answer.headers
    finally:
        relay.shutdown()
        relay.server_close()
        server.stop()
    assert health_state(url, key) == DOWN


def test_the_vllm_guard_proves_the_key_as_relayrl_does(monkeypatch):
    from fastapi import FastAPI

    from relayrl.launch.servers import UNPROVEN, UP, health_state
    from relayrl.runkey import health_proof

    sys.path.insert(0, str(EXTENSION_DIR))
    from relayrl_vllm_guard import RelayGuard
    from relayrl_vllm_guard import health_proof as guard_proof

    assert guard_proof("k", 8000, "c") == health_proof("k", 8000, "c")
    key = new_key()
    monkeypatch.setenv("RELAYRL_API_KEY", key)
    app = FastAPI()
    app.get("/health")(lambda: {})
    app.add_middleware(RelayGuard)
    server = ServerThread(app).start()
    try:
        assert health_state(server.url, key) == UP
        assert health_state(server.url, new_key()) == UNPROVEN
    finally:
        server.stop()


@pytest.fixture
def make_engine_app(tiny_model_dir):
    """A keyed built-in server's app over the tiny model (engines shut down afterwards)."""
    from relayrl.engine.engine import Engine

    engines: list[Engine] = []

    def make(key: str):
        engines.append(Engine.from_pretrained(str(tiny_model_dir)))
        return create_app(engines[-1], key)

    yield make
    for engine in engines:
        engine.shutdown()


def listening_inode(port: int) -> str:
    """The inode of the one socket listening on 127.0.0.1:``port`` (``/proc/net/tcp``)."""
    local = f"0100007F:{port:04X}"
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    (inode,) = [r[9] for r in rows if r[1] == local and r[3] == "0A"]  # 0A: LISTEN
    return inode


def test_a_launched_vllm_server_serves_the_socket_the_launcher_bound(vllm_server):
    """vLLM serves the socket the launcher bound (the launcher holds the same one, so the
    port was never free) and proves the key on /health (relayrl_vllm_guard)."""
    from relayrl.launch.servers import UP, health_state

    url = vllm_server.urls[0]
    assert health_state(url, vllm_server.key_of(0)) == UP
    inode = listening_inode(int(url.rsplit(":", 1)[1]))
    assert f"socket:[{inode}]" in open_files()  # the launcher's copy of vLLM's socket


def open_files() -> set[str]:
    """What this process's file descriptors point to (``socket:[inode]`` for sockets)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed since
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
    return out
