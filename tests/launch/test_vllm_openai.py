"""vLLM's own OpenAI endpoints (what a `rollout.engine=vllm` server offers agent code), driven
by the official ``openai`` client against a REAL vLLM server over the tiny model with the
Hermes-style chat template of tests/engine/test_openai_client.py and vLLM's tool parser on:
models.list(); chat with ``n``, ``top_logprobs`` and ``return_token_ids`` (the prompt ids are
the template's, the logprobs the policy's); streaming with the usage last and the same tokens
as the whole answer; a tool conversation rendered through the template and a named
``tool_choice`` answered with a tool call (vLLM's guided decoding). What the test measured
about vLLM's ``top_logprobs`` is stated in docs/agents.md."""

from __future__ import annotations

import shutil

import openai
import pytest
import torch

from relayrl.models.loading import load_model, load_tokenizer
from tests.engine.test_openai_client import TEMPLATE, WEATHER, template_ids, tool_conversation
from tests.launch._vllm import MAX_LOGPROB_DIFF, needs_vllm, vllm_servers

# its own vLLM server (chat template, tool parser): about 50 s, so outside the 15-minute
# suite; the built-in server's /v1 tests (tests/engine/test_openai_client.py) run there.
# `pytest -m benchmark` runs these
pytestmark = [needs_vllm, pytest.mark.slow, pytest.mark.benchmark]


@pytest.fixture(scope="module")
def templated_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model saved again with the chat template (vLLM reads it from the directory)."""
    out = tmp_path_factory.mktemp("templated") / "model"
    shutil.copytree(tiny_model_dir, out)
    tokenizer = load_tokenizer(out)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def client(templated_dir, tmp_path_factory):
    flags = "rollout.vllm.extra_args=[--enable-auto-tool-choice,--tool-call-parser,hermes]"
    logs = tmp_path_factory.mktemp("vllm-openai-logs")
    with vllm_servers(templated_dir, logs, flags, "model.max_context=512") as launcher:
        with openai.OpenAI(
            base_url=f"{launcher.urls[0]}/v1",
            api_key=launcher.key_of(0),  # the server's own key: the OpenAI client sends it
            max_retries=0,
            timeout=120,
        ) as oai:
            yield oai


def test_models_list(client):
    (model,) = client.models.list().data
    assert model.id == "policy" and model.model_extra["max_model_len"] == 512


def test_chat_ids_logprobs_and_top_logprobs(client, templated_dir):
    tokenizer, model = load_tokenizer(templated_dir), load_model(templated_dir)
    parts = [{"type": "text", "text": "Start at 3. "}, {"type": "text", "text": "Add 4."}]
    answer = client.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": parts}],
        max_tokens=6,
        seed=3,
        n=2,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True},
    )
    prompt = answer.model_extra["prompt_token_ids"]
    # text parts are joined with newlines (as the built-in server does)
    joined = [{"role": "user", "content": "Start at 3. \nAdd 4."}]
    assert prompt == template_ids(tokenizer, joined)
    for choice in answer.choices:
        ids = choice.model_extra["token_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0].float()
        ref = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
        for i, entry in enumerate(choice.logprobs.content):
            assert abs(entry.logprob - ref[i, ids[i]].item()) < MAX_LOGPROB_DIFF
            top = [t.logprob for t in entry.top_logprobs]
            # vLLM 0.32 lists the sampled token first, then the k - 1 most likely others
            assert len(top) == 3 and top[0] == entry.logprob
            others = ref[i].clone()
            others[ids[i]] = -torch.inf
            expected = others.topk(2).values.tolist()
            assert (
                max(abs(a - b) for a, b in zip(top[1:], expected, strict=True)) < MAX_LOGPROB_DIFF
            )


def test_streaming_matches_the_whole_answer(client):
    request = {
        "model": "policy",
        "messages": [{"role": "user", "content": "Start at 7."}],
        "max_tokens": 8,
        "seed": 9,
        "extra_body": {"return_token_ids": True},
    }
    whole = client.chat.completions.create(**request).choices[0]
    ids, content, chunks = (
        [],
        "",
        list(
            client.chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **request
            )
        ),
    )
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            ids += choice.model_extra.get("token_ids") or []
            content += choice.delta.content or ""
    assert ids == whole.model_extra["token_ids"] and content == whole.message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)


def test_tools_render_and_a_named_tool_choice_calls(client, templated_dir):
    _, messages = tool_conversation("sunny")
    answer = client.chat.completions.create(
        model="policy",
        messages=messages,
        tools=[WEATHER],
        max_tokens=2,
        extra_body={"return_token_ids": True},
    )
    text = load_tokenizer(templated_dir).decode(answer.model_extra["prompt_token_ids"])
    assert '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    named = client.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": "Start at 3."}],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "weather"}},
        max_tokens=60,
        temperature=0,
    )
    (called,) = named.choices[0].message.tool_calls
    assert called.function.name == "weather"
