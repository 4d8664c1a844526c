"""relayrl_vllm_guard, the authenticating layer in front of a launched vLLM server, over a
FastAPI app with vLLM's dev-mode route shapes (the real server: test_vllm_backend.py): every
endpoint but the read-only probes needs the key, ``/collective_rpc`` reaches relayrl's
extension methods only and gets the body the client sent, and a server started without a
key leaves nothing open."""

from __future__ import annotations

import asyncio
import sys

import httpx
import pytest
from fastapi import FastAPI, Request

from relayrl.launch.vllm import EXTENSION_DIR

sys.path.insert(0, str(EXTENSION_DIR))
from relayrl_vllm_guard import RelayGuard  # noqa: E402


def dev_mode_app() -> FastAPI:
    app = FastAPI()
    app.state.calls = []

    @app.get("/health")
    async def health():
        return {}

    @app.post("/collective_rpc")
    async def rpc(request: Request):
        body = await request.json()
        app.state.calls.append(body)
        return {"results": [body["method"]]}

    @app.post("/pause")
    async def pause():
        app.state.calls.append("pause")
        return {}

    @app.post("/v1/completions")
    async def completions():
        return {}

    app.add_middleware(RelayGuard)
    return app


def call(app: FastAPI, method: str, path: str, key: str | None = None, json=None) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(transport=transport, base_url="http://s") as client:
            return await client.request(method, path, json=json, headers=headers)

    return asyncio.run(go())


@pytest.fixture
def guarded(monkeypatch):
    monkeypatch.setenv("RELAYRL_API_KEY", "run-key")
    return dev_mode_app()


def test_everything_but_the_probes_needs_the_key(guarded):
    assert call(guarded, "GET", "/health").status_code == 200
    for path in ("/pause", "/v1/completions", "/collective_rpc"):
        for key in (None, "wrong", "run-key "):
            body = {"method": "relayrl_load_weights"}
            assert call(guarded, "POST", path, key, body).status_code == 401, (path, key)
    assert guarded.state.calls == []
    assert call(guarded, "POST", "/pause", "run-key").status_code == 200
    assert guarded.state.calls == ["pause"]


def test_collective_rpc_reaches_relayrl_methods_only(guarded):
    """The attack: ``/collective_rpc`` with any worker method by name (vLLM's own
    ``reload_weights``, ``execute_model``, a private one), key or not."""
    for method in ("reload_weights", "execute_model", "_relayrl_reload", "relayrl_x", None, 5):
        answer = call(guarded, "POST", "/collective_rpc", "run-key", {"method": method})
        assert answer.status_code == 403, method
        assert "not one of relayrl's" in answer.json()["error"]
    body = {"method": "relayrl_load_weights", "kwargs": {"weights_path": "/w"}}
    answer = call(guarded, "POST", "/collective_rpc", "run-key", body)
    assert answer.status_code == 200 and answer.json() == {"results": ["relayrl_load_weights"]}
    assert guarded.state.calls == [body]  # the body reached vLLM unchanged
    big = {"method": "relayrl_load_weights", "kwargs": {"weights_path": "x" * (2 << 20)}}
    assert call(guarded, "POST", "/collective_rpc", "run-key", big).status_code == 413


def test_without_a_key_nothing_but_the_probes_is_open(monkeypatch):
    monkeypatch.delenv("RELAYRL_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    app = dev_mode_app()
    assert call(app, "GET", "/health").status_code == 200
    assert call(app, "POST", "/pause").status_code == 401
    assert call(app, "POST", "/pause", "").status_code == 401


def test_the_launched_command_guards_and_keeps_the_key_out_of_argv(tiny_model_dir):
    from relayrl.errors import RelayError
    from relayrl.launch.vllm import GUARD_CLASS, VLLMServerSpec

    spec = VLLMServerSpec(str(tiny_model_dir), sys.executable, api_key="k" * 43)
    argv = spec.command(8000)
    assert argv[argv.index("--middleware") + 1] == GUARD_CLASS
    assert "k" * 43 not in " ".join(argv) and "--api-key" not in argv
    env = spec.environment(0)
    assert env["RELAYRL_API_KEY"] == env["VLLM_API_KEY"] == "k" * 43
    with pytest.raises(RelayError, match="need an API key"):
        VLLMServerSpec(str(tiny_model_dir), sys.executable).command(8000)
