"""vLLM's token-in, token-out route ``POST /inference/v1/generate`` on the built-in server
(issue 48: verifiers' training client got 404 on every rollout). Over a keyed loopback
server: the request verifiers' client posts (through the ``renderers`` package's vLLM
transport: ``model``, ``token_ids``, ``sampling_params``) answered with the tokens
``/generate`` gives for the same seed and the policy's logprobs (recomputed by a full
forward pass), read the way that client reads them; relayrl's own vLLM client generating a
group on it, versions included; the key required; unsupported fields refused by name."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from relayrl.engine.server import ServerThread, create_app
from relayrl.engine.types import SamplingParams
from relayrl.engine.vllm_client import VLLMClient
from tests.engine.conftest import recompute_logprobs

KEY = "run-key"
PROMPT = [5, 6, 7, 8]


@pytest.fixture
def keyed(make_engine):
    """(engine, url) of a server over the tiny model that requires ``KEY``."""
    engine = make_engine(weight_version=3)
    server = ServerThread(create_app(engine, KEY)).start()
    yield engine, server.url
    server.stop()


def post(url: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/inference/v1/generate", json=body, headers=headers, timeout=60)


def renderers_request(prompt: list[int], **sampling) -> dict:
    """The body the renderers package's vLLM transport posts for verifiers' client."""
    return {"model": "policy", "token_ids": prompt, "sampling_params": sampling}


def test_verifiers_request_gets_the_policys_tokens_and_logprobs(keyed, tiny_model):
    engine, url = keyed
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 8, "logprobs": 1, "seed": 11}
    sampling |= {"skip_special_tokens": False, "ignore_eos": True}
    answer = post(url, renderers_request(PROMPT, **sampling))
    assert answer.status_code == 200, answer.text
    data = answer.json()
    choice = (data.get("choices") or [{}])[0]  # what renderers' client reads, as it reads it
    ids = list(choice.get("token_ids") or [])
    logprobs = [float(c.get("logprob") or 0.0) for c in choice["logprobs"]["content"]]
    assert len(ids) == 8 and choice["finish_reason"] == "length" and data["request_id"]
    reference = recompute_logprobs(tiny_model, PROMPT, ids, 1.0)
    assert max(abs(a - b) for a, b in zip(logprobs, reference, strict=True)) < 1e-4
    same = SamplingParams(max_new_tokens=8, seed=11, ignore_eos=True)
    assert engine.generate_batch([PROMPT], same)[0].output_ids == ids  # as /generate samples
    top = choice["logprobs"]["content"][0]["top_logprobs"]
    assert len(top) == 1 and top[0]["logprob"] >= logprobs[0] - 1e-6
    assert choice["weight_versions"] == [{"start": 0, "end": 8, "version": "3"}]
    assert data["usage"] == {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12}


def test_relayrls_vllm_client_generates_a_group_on_it(keyed, tiny_model):
    _, url = keyed
    params = [{"max_new_tokens": 6, "seed": 40 + j, "ignore_eos": True} for j in range(3)]

    async def group():
        async with VLLMClient([url], api_key=KEY) as client:
            return await client.generate_many([PROMPT] * 3, params)

    samples = asyncio.run(group())
    assert len({tuple(s.output_ids) for s in samples}) > 1  # seeds 40, 41, 42
    for sample in samples:
        assert sample.output_versions == [3] * 6 and sample.finish_reason == "length"
        reference = recompute_logprobs(tiny_model, PROMPT, sample.output_ids, 1.0)
        assert (
            max(abs(a - b) for a, b in zip(sample.output_logprobs, reference, strict=True)) < 1e-4
        )


def test_the_route_requires_the_key(keyed):
    _, url = keyed
    assert post(url, renderers_request(PROMPT, max_tokens=2), key=None).status_code == 401
    assert post(url, renderers_request(PROMPT, max_tokens=2), key="wrong").status_code == 401


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (renderers_request(PROMPT, repetition_penalty=1.3), "sampling_params.repetition_penalty"),
        (renderers_request(PROMPT, guided_json={}), "sampling_params.guided_json"),
        ({"token_ids": PROMPT, "features": {}}, "features"),
        (renderers_request(PROMPT, max_tokens=10**6), "token_ids"),
        (renderers_request([10**7]), "token_ids"),
    ],
)
def test_what_the_engine_cannot_do_is_a_400_naming_it(keyed, body, param):
    _, url = keyed
    answer = post(url, body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param
