"""``relayrl serve`` without a key is closed by default (docs/security.md): generation and
reading are served, the control plane (weight loads, pause, resume, transfer groups) answers
403 with a message saying how to set a key; ``--open-control-plane`` opts into the old open
behaviour, on a loopback host only. Before, a keyless server took weight loads and pauses
from any local user (it only warned)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from relayrl.engine.server import ServerThread, create_app
from relayrl.runkey import API_KEY_ENV, API_KEY_FILE_ENV
from tests.engine.test_server import MUTATING

CLI = [sys.executable, "-c", "import sys; from relayrl.cli import main; sys.exit(main())"]


def keyless_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in (API_KEY_ENV, API_KEY_FILE_ENV)}


def wait_serving(proc: subprocess.Popen, url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"relayrl serve exited with {proc.returncode}"
        assert time.monotonic() < deadline, "relayrl serve did not answer /health in time"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def test_relayrl_serve_without_a_key_serves_generation_and_refuses_control(
    tiny_model_dir, tmp_path
):
    from relayrl.launch.servers import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "serve.log", "w") as log:
        proc = subprocess.Popen(
            [*CLI, "serve", "--model", str(tiny_model_dir), "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=keyless_env(),
        )
    try:
        wait_serving(proc, url)
        for method, path, body in MUTATING:
            answer = httpx.request(method, url + path, json=body, timeout=30)
            assert answer.status_code == 403, (path, answer.text)
            message = answer.json()["error"]
            assert "--api-key-file" in message and "--open-control-plane" in message
        generated = httpx.post(
            f"{url}/generate",
            json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}},
            timeout=60,
        )
        assert generated.status_code == 200 and generated.json()["output_ids"]
        info = httpx.get(f"{url}/get_model_info", timeout=30).json()
        assert info["weight_version"] == 0  # nothing was loaded
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "the control plane is closed" in (tmp_path / "serve.log").read_text()


def test_open_control_plane_is_loopback_only(tiny_model_dir):
    out = subprocess.run(
        [*CLI, "serve", "--model", str(tiny_model_dir), "--host", "10.1.2.3"]
        + ["--open-control-plane"],
        capture_output=True,
        text=True,
        timeout=120,
        env=keyless_env(),
    )
    assert out.returncode != 0
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "loopback host only" in errors[0], out.stderr


@pytest.mark.parametrize("open_control_plane", [False, True])
def test_a_keyless_app_opens_its_control_plane_only_when_told(make_engine, open_control_plane):
    server = ServerThread(create_app(make_engine(), None, open_control_plane)).start()
    try:
        answer = httpx.post(f"{server.url}/pause_generation", json={"mode": "abort"}, timeout=30)
        assert answer.status_code == (200 if open_control_plane else 403)
        httpx.post(f"{server.url}/continue_generation", timeout=30)
    finally:
        server.stop()
