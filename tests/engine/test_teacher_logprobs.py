"""A teacher server scores given tokens (on-policy distillation): SGLang's input-token
logprobs (``logprob_start_len``, ``max_new_tokens = 0``) over a real loopback server equal a
plain Hugging Face forward pass, and the client fetches a whole group in one request."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from relayrl.engine.client import RolloutClient, RolloutServerError
from relayrl.engine.server import ServerThread, create_app
from tests.engine.conftest import recompute_logprobs


@pytest.fixture
def teacher(make_engine):
    engine = make_engine()
    server = ServerThread(create_app(engine)).start()
    yield engine, server.url
    server.stop()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_input_logprobs_equal_a_plain_forward(teacher, tiny_model, temperature):
    _, url = teacher
    prompt, completion = [5, 6, 7, 8], [9, 10, 11]
    body = {
        "input_ids": prompt + completion,
        "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
        "return_logprob": True,
        "logprob_start_len": len(prompt),
    }
    data = httpx.post(f"{url}/generate", json=body, timeout=30).json()
    got = data["meta_info"]["input_token_logprobs"]
    assert [t[1] for t in got] == completion and data["output_ids"] == []
    expected = recompute_logprobs(tiny_model, prompt, completion, temperature)
    assert [t[0] for t in got] == pytest.approx(expected, abs=1e-5)
    # from position 0: the first token has no logprob (SGLang's None)
    body["logprob_start_len"] = 0
    data = httpx.post(f"{url}/generate", json=body, timeout=30).json()
    assert data["meta_info"]["input_token_logprobs"][0][0] is None


def test_client_scores_a_group_in_one_request(teacher, tiny_model):
    _, url = teacher
    prompt, completions = [5, 6, 7], [[9, 10, 11, 12], [13], [14, 15]]

    async def fetch():
        async with RolloutClient(url) as client:
            return await client.input_logprobs(prompt, completions, 1.0)

    got = asyncio.run(fetch())
    for c, lps in zip(completions, got, strict=True):
        assert lps == pytest.approx(recompute_logprobs(tiny_model, prompt, c, 1.0), abs=1e-5)


def test_scoring_requests_are_checked(teacher):
    _, url = teacher
    base = {"input_ids": [5, 6, 7], "return_logprob": True, "logprob_start_len": 1}
    cases = [
        ({"sampling_params": {"max_new_tokens": 4}}, "max_new_tokens=0"),
        ({"sampling_params": {"max_new_tokens": 0}, "logprob_start_len": 3}, ">= 3 tokens"),
        ({"sampling_params": {"max_new_tokens": 0, "temperature": 0}}, "temperature"),
        ({"sampling_params": {"max_new_tokens": 0}, "input_ids": [5, 10**9]}, "vocabulary"),
    ]
    for extra, message in cases:
        r = httpx.post(f"{url}/generate", json={**base, **extra}, timeout=30)
        assert r.status_code == 400 and message in r.json()["error"], r.text

    async def bad_client():
        async with RolloutClient(url) as client:
            await client.input_logprobs([], [[5]], 1.0)

    with pytest.raises(RolloutServerError, match="400"):
        asyncio.run(bad_client())
