"""A server that cannot serve says so (issue 48): ``relayrl serve --model DIR`` answered 500
to every request while ``GET /health`` said ok when its KV allocation failed. Now
``/health`` is 503 with the error while the engine's last step failed (and ok again once a
step succeeds) or its loop has stopped, and ``relayrl serve`` over an engine that cannot
generate exits with one error line instead of serving. The failure is the allocator's error
raised where the engine's forward pass allocates the KV cache."""

from __future__ import annotations

import threading

import httpx
import pytest

from relayrl.cli import main
from relayrl.engine.model_runner import ModelRunner
from tests.engine.test_server import served  # noqa: F401 - the fixture

ALLOCATION_FAILED = (
    "DefaultCPUAllocator: can't allocate memory: you tried to allocate 12884901888 bytes.\n"
    "Error code 12 (Cannot allocate memory)"
)
REQUEST = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


def failing_forward(self, input_ids, attention_mask, position_ids):
    raise RuntimeError(ALLOCATION_FAILED)


def test_health_says_what_fails_while_every_request_fails(served, monkeypatch):  # noqa: F811
    engine, url = served()
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    monkeypatch.setattr(ModelRunner, "forward", failing_forward)
    assert httpx.post(f"{url}/generate", json=REQUEST, timeout=30).status_code == 500
    health = httpx.get(f"{url}/health")
    assert health.status_code == 503 and health.json()["status"] == "error"
    assert "can't allocate memory" in health.json()["error"]
    assert "\n" not in health.json()["error"]
    monkeypatch.undo()  # the memory is back: the next step succeeds, and health with it
    assert httpx.post(f"{url}/generate", json=REQUEST, timeout=30).status_code == 200
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


def test_health_after_the_engine_stopped(served):  # noqa: F811
    engine, url = served()
    engine.shutdown()
    health = httpx.get(f"{url}/health")
    assert health.status_code == 503 and "loop has stopped" in health.json()["error"]


def test_serve_refuses_to_start_an_engine_that_cannot_generate(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setattr(ModelRunner, "forward", failing_forward)
    codes: list[int] = []
    argv = ["serve", "--model", str(tiny_model_dir), "--port", "0"]
    thread = threading.Thread(target=lambda: codes.append(main(argv)), daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the server started serving an engine that cannot generate"
    assert codes == [2]  # RelayError's exit code
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert "failed its first generation" in errors[0] and "can't allocate memory" in errors[0]


@pytest.mark.parametrize("max_seq_len", [2, 64])
def test_serve_starts_a_healthy_engine(tiny_model_dir, max_seq_len):
    """The start check fits any context (two tokens of a 2-token context: one)."""
    from relayrl.engine.engine import Engine
    from relayrl.engine.serve import check_generates
    from relayrl.engine.types import EngineOptions

    with Engine.from_pretrained(tiny_model_dir, EngineOptions(max_seq_len=max_seq_len)) as engine:
        check_generates(engine)
        assert engine.stats()["generated_tokens"] == min(2, max_seq_len - 1)
        assert engine.health_problem() is None
