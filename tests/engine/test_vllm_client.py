"""The vLLM wire protocol without a server: sampling parameters as vLLM's, per-token versions
from ``weight_versions`` spans, and answers that cannot be trusted refused (the real server
is exercised in tests/launch/test_vllm_backend.py)."""

from __future__ import annotations

import pytest

from relayrl.engine.client import RolloutServerError, ServingInfo
from relayrl.engine.types import SamplingParams
from relayrl.engine.vllm_client import (
    group_request,
    parse_serving_info,
    parse_vllm_generation,
    parse_vllm_group,
    span_versions,
    vllm_sampling_params,
)
from relayrl.launch.vllm import VLLMServerSpec

URL = "http://127.0.0.1:1"


def answer(ids, logprobs, spans, reason="length"):
    content = [{"token_id": t, "logprob": lp} for t, lp in zip(ids, logprobs, strict=True)]
    return {
        "choices": [
            {
                "token_ids": ids,
                "logprobs": {"content": content},
                "weight_versions": spans,
                "finish_reason": reason,
            }
        ],
        "usage": {"prompt_tokens": 5},
    }


def test_sampling_params_map_to_vllm_fields():
    params = SamplingParams(max_new_tokens=7, temperature=0.7, seed=3, stop_token_ids=[1])
    wire = vllm_sampling_params(params.__dict__)
    assert wire == {
        "max_tokens": 7,
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": -1,
        "logprobs": 0,
        "ignore_eos": False,
        "skip_special_tokens": False,
        "detokenize": False,
        "seed": 3,
        "stop_token_ids": [1],
    }
    with pytest.raises(ValueError, match="stop strings"):
        vllm_sampling_params({"stop": ["\n"]})


def test_spans_become_per_token_versions():
    spans = [{"version": "default", "start": 0, "end": 2}, {"version": "3", "start": 2, "end": 5}]
    assert span_versions(spans, 5, URL) == [0, 0, 3, 3, 3]
    assert span_versions(None, 0, URL) == []
    for bad, n in (
        ([{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 3, "end": 4}], 4),
        ([{"version": "1", "start": 0, "end": 2}], 3),
        ([{"version": "v1", "start": 0, "end": 1}], 1),
        (None, 2),
    ):
        with pytest.raises(RolloutServerError):
            span_versions(bad, n, URL)


def test_an_answer_becomes_a_generation():
    gen = parse_vllm_generation(
        URL, answer([4, 5, 6], [-0.1, -0.2, -0.3], [{"version": "2", "start": 0, "end": 3}])
    )
    assert gen.output_ids == [4, 5, 6] and gen.output_logprobs == [-0.1, -0.2, -0.3]
    assert gen.output_versions == [2, 2, 2]
    assert gen.finish_reason == "length" and gen.prompt_tokens == 5
    missing = answer([4, 5], [-0.1, -9999.0], [{"version": "2", "start": 0, "end": 2}])
    with pytest.raises(RolloutServerError, match="logprobs missing"):
        parse_vllm_generation(URL, missing)


def test_a_group_with_consecutive_seeds_is_one_request_with_n():
    """vLLM samples child j of an ``n`` request with seed ``seed + j``: a group sharing the
    prompt and every parameter, seeded s0, s0+1, ..., is that request; anything else is not."""
    prompt = [5, 6, 7]
    group = [SamplingParams(max_new_tokens=9, seed=41 + j).__dict__ for j in range(3)]
    body = group_request([prompt] * 3, group)
    assert body == {
        "token_ids": [5, 6, 7],
        "sampling_params": vllm_sampling_params(group[0]) | {"n": 3},
    }
    assert body["sampling_params"]["seed"] == 41
    unseeded = [SamplingParams(max_new_tokens=9).__dict__] * 2
    assert group_request([prompt] * 2, unseeded)["sampling_params"]["n"] == 2
    assert "seed" not in group_request([prompt] * 2, unseeded)["sampling_params"]
    for prompts, params in (
        ([prompt, [5, 6, 8], prompt], group),  # prompts differ
        ([prompt] * 3, [group[0], group[2], group[1]]),  # seeds not s0 + j
        ([prompt] * 3, [group[0], group[1], dict(group[2], seed=None)]),
        ([prompt] * 2, [dict(group[0], seed=None), group[1]]),
        ([prompt] * 2, [group[0], dict(group[1], temperature=0.5)]),  # params differ
        ([prompt] * 2, [group[0], dict(group[1], max_new_tokens=8)]),
    ):
        assert group_request(prompts, params) is None


def test_a_group_answer_becomes_its_samples_in_seed_order():
    one = answer([4], [-0.5], [{"version": "1", "start": 0, "end": 1}])["choices"][0]
    two = answer([8, 9], [-0.1, -0.2], [{"version": "1", "start": 0, "end": 2}], "abort")
    data = {"choices": [dict(two["choices"][0], index=1), dict(one, index=0)], "usage": {}}
    first, second = parse_vllm_group(URL, data, 2)
    assert first.output_ids == [4] and first.output_versions == [1]
    assert second.output_ids == [8, 9] and second.finish_reason == "abort"
    with pytest.raises(RolloutServerError, match="group of 3 came back with 2 choices"):
        parse_vllm_group(URL, data, 3)


def test_serving_info_from_models_and_weight_info():
    """What evaluation reads of a vLLM server: context length and the version it serves."""
    models = {"object": "list", "data": [{"id": "m", "max_model_len": 128, "root": "m"}]}
    assert parse_serving_info(URL, models, {"weight_version": "default"}) == ServingInfo(128, 0)
    assert parse_serving_info(URL, models, {"weight_version": "7"}) == ServingInfo(128, 7)
    for bad_models, bad_info, match in (
        ({"data": []}, {"weight_version": "1"}, "max_model_len"),
        ({"data": [{"id": "m"}]}, {"weight_version": "1"}, "max_model_len"),
        (models, {}, "weight_version"),
        (models, {"weight_version": "step-3"}, "not an integer"),
    ):
        with pytest.raises(RolloutServerError, match=match):
            parse_serving_info(URL, bad_models, bad_info)


def test_the_server_command_asks_for_exact_rl_data():
    spec = VLLMServerSpec(
        "/m", "/py", max_seq_len=128, threads_bind="0|1", prefix_caching=False, api_key="k"
    )
    cmd = spec.command(8000)
    assert cmd[:2] == ["/py", "-c"]
    flags = " ".join(cmd[3:])
    assert "--logprobs-mode processed_logprobs" in flags
    assert "--enable-scale-out" in flags and "--no-enable-chunked-prefill" in flags
    assert "--worker-extension-cls relayrl_vllm_ext.RelayWeightLoader" in flags
    assert "--max-model-len 128" in flags and "--no-enable-prefix-caching" in flags
    assert spec.environment(1)["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert spec.environment(0)["VLLM_SERVER_DEV_MODE"] == "1"
    assert "--middleware relayrl_vllm_guard.RelayGuard" in flags  # dev mode behind the key
