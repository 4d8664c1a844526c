"""Servers someone else started (``rollout.server_urls``, ``relayrl eval --server-url``) prove
that they hold the key before the client sends it (docs/security.md, "Servers someone else
started"). Before, the client checked only that ``GET /health`` answered 200 and then sent
``Authorization: Bearer <key>`` on every request: whoever listened on a configured URL's port
(a local user who bound it while the server was down, a relay) received the key. Now each URL
must answer the ``/health`` challenge with the proof of the key for its own port
(``relayrl.runkey.health_proof``), as launched servers do; one that does not is one ``error:``
line naming it, and it has received nothing but that ``GET /health``.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from relayrl.cli import main
from relayrl.config.loader import load_config
from relayrl.engine.client import RolloutClient
from relayrl.errors import RelayError
from relayrl.launch.backends import make_backend
from relayrl.launch.servers import ExternalServers, free_port
from relayrl.launch.supervisor import ServerSupervisor
from relayrl.rollout.distill import TeacherScorer
from relayrl.runkey import API_KEY_ENV, API_KEY_FILE_ENV, CHALLENGE_HEADER, PROOF_HEADER, new_key
from relayrl.train.run.rollout import teacher_scorer
from tests.engine.test_serve_closed import CLI, wait_serving


@dataclass
class Squatter:
    """An HTTP server on a loopback port that answers every request 200 and records what it
    was sent; ``GET /health`` gets ``proof(challenge)`` as its proof header (None: none)."""

    proof: object = None  # Callable[[str], str] | None
    requests: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        squatter = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self.answer()

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.answer()

            def answer(self) -> None:
                squatter.requests.append(
                    {"method": self.command, "path": self.path, **dict(self.headers.items())}
                )
                challenge = self.headers.get(CHALLENGE_HEADER)
                self.send_response(200)
                if challenge is not None and squatter.proof is not None:
                    self.send_header(PROOF_HEADER, squatter.proof(challenge))
                body = b'{"status": "ok", "weight_version": 0, "max_context_length": 64}'
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def authorizations(self) -> list[str]:
        """Every Authorization header it received (header names are case-insensitive)."""
        return [v for r in self.requests for k, v in r.items() if k.lower() == "authorization"]


@dataclass
class RelayrlServe:
    """``relayrl serve`` over the tiny model on a loopback port, started here as a user
    would, with ``key`` in its environment."""

    proc: subprocess.Popen
    url: str
    key: str


@pytest.fixture(scope="module")
def real_server(tiny_model_dir, tmp_path_factory) -> Iterator[RelayrlServe]:
    key, port = new_key(), free_port()
    env = {k: v for k, v in os.environ.items() if k != API_KEY_FILE_ENV}
    env.update({API_KEY_ENV: key, "OMP_NUM_THREADS": "1"})
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*CLI, "serve", "--model", str(tiny_model_dir), "--port", str(port), "--threads", "1"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_serving(proc, url)
        yield RelayrlServe(proc, url, key)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(autouse=True)
def no_key_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(API_KEY_FILE_ENV, raising=False)


def external_backend(model_dir: Path, url: str, key: str | None):
    overrides = [f"model.path={model_dir}", "model.max_context=64"]
    overrides += [f"rollout.server_urls=[{url}]", "rollout.startup_timeout_s=5"]
    if key is not None:
        overrides.append(f"rollout.api_key={key}")
    return make_backend(load_config(None, overrides), model_dir)


async def generate(backend, urls: list[str]) -> list[int]:
    """What the run does once its servers are up: its checks, then a generation."""
    async with backend.client(urls) as client:
        await backend.check_servers(client)
        out = await client.generate([5, 6], {"max_new_tokens": 3, "ignore_eos": True})
        return out.output_ids


def relay_to(target: str):
    """A proof copied from the server at ``target`` (listening on another port)."""

    def proof(challenge: str) -> str:
        answer = httpx.get(target + "/health", headers={CHALLENGE_HEADER: challenge}, timeout=10)
        return answer.headers.get(PROOF_HEADER, "")

    return proof


IMPOSTORS = {
    "no proof": lambda server: None,
    "a made-up proof": lambda server: lambda challenge: secrets.token_hex(32),
    "the real server's proof, relayed": lambda server: relay_to(server.url),
}


@pytest.mark.parametrize("impostor", IMPOSTORS)
def test_a_squatter_on_a_server_url_never_receives_the_key(
    impostor, real_server, tiny_model_dir, tmp_path
):
    squatter = Squatter(IMPOSTORS[impostor](real_server))
    backend = external_backend(tiny_model_dir, squatter.url, real_server.key)
    try:
        with pytest.raises(RelayError) as refused:  # the run's path: start, check, generate
            with backend.launcher(tmp_path) as servers:
                asyncio.run(generate(backend, servers.urls))
    finally:
        squatter.close()
    port = squatter.url.rsplit(":", 1)[1]
    assert str(refused.value).startswith(
        f"rollout.server_urls[0]: {squatter.url} answered GET /health without proving that it "
        f"holds the key; expected its x-relayrl-proof header to be HMAC-SHA256(key, "
        f"'relayrl-health {port} <challenge>')"
    )
    assert squatter.authorizations() == []
    assert [(r["method"], r["path"]) for r in squatter.requests] == [("GET", "/health")]


def test_a_server_started_with_the_key_proves_it_and_serves_the_run(
    real_server, tiny_model_dir, tmp_path
):
    backend = external_backend(tiny_model_dir, real_server.url, real_server.key)
    with backend.launcher(tmp_path) as servers:
        assert servers.urls == [real_server.url]
        assert len(asyncio.run(generate(backend, servers.urls))) == 3


def test_a_server_started_with_another_key_is_refused_before_the_key_is_sent(
    real_server, tiny_model_dir, tmp_path
):
    backend = external_backend(tiny_model_dir, real_server.url + "/", new_key())
    with pytest.raises(RelayError, match=r"rollout.server_urls\[0\]: .* without proving"):
        backend.launcher(tmp_path).start()


def test_without_a_key_nothing_is_proved_nor_sent(tiny_model_dir, tmp_path):
    """A run with no key (keyless servers someone else started) talks to them as before."""
    squatter = Squatter()
    try:
        backend = external_backend(tiny_model_dir, squatter.url, None)
        assert backend.launcher(tmp_path).start() == [squatter.url]
    finally:
        squatter.close()
    assert squatter.authorizations() == []


@pytest.mark.parametrize(
    ("where", "squatted"),
    [
        ("rollout.server_urls[0]", ["rollout.server_urls=[{url}]"]),
        ("distill.teacher", ["distill.teacher={url}", "rollout.lag=fixed"]),  # no server
    ],
)
def test_relayrl_train_on_a_squatted_url_is_one_error_line(
    where, squatted, tiny_model_dir, tmp_path, capsys, monkeypatch
):
    key = new_key()
    monkeypatch.setenv(API_KEY_ENV, key)  # as docs/security.md says to give it
    squatter = Squatter(IMPOSTORS["a made-up proof"](None))
    config = tmp_path / "run.yaml"
    config.write_text(f"model:\n  path: {tiny_model_dir}\n  max_context: 128\n")
    overrides = [f"output_dir={tmp_path}", "name=squatted"]
    overrides += [override.format(url=squatter.url) for override in squatted]
    overrides += ["rollout.reward_workers=1", "train.progress=false", "runtime.threads=1"]
    try:
        code = main(["train", str(config), *overrides])
    finally:
        squatter.close()
    assert squatter.authorizations() == []
    assert key not in str(squatter.requests)
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0
    assert len(err) == 1 and err[0].startswith(
        f"error: {where}: {squatter.url} answered GET /health without proving"
    ), err


def test_relayrl_eval_on_a_squatted_server_url_is_one_error_line(
    tiny_model_dir, capsys, monkeypatch
):
    monkeypatch.setenv(API_KEY_ENV, new_key())
    squatter = Squatter()
    try:
        argv = ["eval", "--model", str(tiny_model_dir), "--data", "arithmetic"]
        code = main([*argv, "--server-url", squatter.url])
    finally:
        squatter.close()
    assert squatter.authorizations() == []
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0
    assert len(err) == 1 and err[0].startswith(
        f"error: --server-url[0]: {squatter.url} answered GET /health without proving"
    ), err


async def recover_from(url: str, key: str) -> str:
    """What the run does when a request to ``url`` (one of ``rollout.server_urls``) cannot
    connect: ask the supervisor where to resubmit it."""
    servers = ExternalServers([url], api_key=key)
    async with RolloutClient(servers.urls, api_key=key) as client:
        supervisor = ServerSupervisor(servers, client, max_restarts=0)  # as a run: none
        return await supervisor.recover(url)  # the client's failover callback


def test_a_squatter_on_the_port_of_a_server_that_died_mid_run_gets_no_request_back():
    """The server at a URL proved the key at the start, then died, and another process
    bound its port at once: before the requests that failed go back to that URL, it must
    prove the key again. The squatter cannot; it receives that one GET /health and the run
    stops naming the URL (a server someone else started cannot be replaced)."""
    key = new_key()
    squatter = Squatter(IMPOSTORS["a made-up proof"](None))
    try:
        with pytest.raises(RelayError) as stopped:
            asyncio.run(recover_from(squatter.url, key))
    finally:
        squatter.close()
    assert str(stopped.value).startswith(
        f"rollout server 0 ({squatter.url}, external) answered GET /health without proving "
        "that it holds the key"
    )
    assert squatter.authorizations() == []
    assert [(r["method"], r["path"]) for r in squatter.requests] == [("GET", "/health")]


def test_a_server_that_still_proves_the_key_gets_its_requests_back(real_server):
    """A transient connection error on a server that holds the key: same URL, no restart."""
    assert asyncio.run(recover_from(real_server.url, real_server.key)) == real_server.url


def teacher_config(model_dir: Path, url: str, key: str):
    overrides = [f"model.path={model_dir}", "rollout.startup_timeout_s=5"]
    return load_config(None, [*overrides, f"distill.teacher={url}", f"distill.api_key={key}"])


@pytest.mark.parametrize("impostor", ["no proof", "a made-up proof"])
def test_a_squatter_on_a_teacher_url_never_receives_the_key(impostor, tiny_model_dir):
    """``distill.teacher`` as a URL someone else started: the same proof before its key
    (``distill.api_key``) is sent to it."""
    key = new_key()
    squatter = Squatter(IMPOSTORS[impostor](None))
    try:
        with pytest.raises(RelayError) as refused:
            teacher_scorer(teacher_config(tiny_model_dir, squatter.url, key))
    finally:
        squatter.close()
    message = str(refused.value)
    assert message.startswith(
        f"distill.teacher: {squatter.url} answered GET /health without proving that it holds "
        "the key"
    )
    assert "from a server started with the key of distill.api_key / $RELAYRL_API_KEY" in message
    assert squatter.authorizations() == []
    assert [(r["method"], r["path"]) for r in squatter.requests] == [("GET", "/health")]


def test_a_teacher_started_with_the_key_proves_it(real_server, tiny_model_dir):
    config = teacher_config(tiny_model_dir, real_server.url, real_server.key)
    assert isinstance(teacher_scorer(config), TeacherScorer)
