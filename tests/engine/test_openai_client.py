"""The built-in server's ``/v1`` endpoints driven by the official ``openai`` client, over a
real loopback server whose tokenizer has a Qwen/Hermes-style chat template with tools:
models.list(); chat answers whose prompt ids are exactly the template's, whose logprobs and
top_logprobs are the policy's (recomputed by a full forward pass); a streamed answer equal to
the whole one (same seed) with the usage last; a stop string cut from the content; a tool
conversation (``content: null`` + ``tool_calls``, a ``tool`` turn, ``tools``) rendered as the
template renders it; text completions from text and from ids; unsupported fields refused by
name (the client's BadRequestError carries the message); a client that closes a stream has
its requests aborted."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from relayrl.engine.engine import Engine
from relayrl.engine.server import ServerThread, create_app
from relayrl.engine.types import EngineOptions
from relayrl.models.loading import load_tokenizer
from tests.engine.conftest import recompute_logprobs

# A small chat template in the Hermes format (Qwen 2.5/3 use this layout): tools listed in
# the system turn, calls as <tool_call>{json}</tool_call>, results as <tool_response>.
TEMPLATE = (
    "{%- if tools or messages[0].role == 'system' %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}"
    "{% if tools %}<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>"
    "{% endif %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}{% if not (loop.first and m.role == 'system') %}"
    "<|im_start|>{{ 'user' if m.role == 'tool' else m.role }}\n"
    "{% if m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>"
    "{% else %}{{ m.content }}{% endif %}"
    '{% for c in m.tool_calls or [] %}<tool_call>{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}'
    "<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# short: the tiny model's tokenizer (trained on arithmetic) spends a token per JSON character
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture
def templated(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@contextlib.contextmanager
def openai_server(model, tokenizer, model_dir) -> Iterator[tuple[Engine, openai.OpenAI]]:
    """(engine, client): a loopback server over ``model`` with ``tokenizer``'s template."""
    engine = Engine(model, tokenizer, EngineOptions(), model_path=str(model_dir))
    server = ServerThread(create_app(engine)).start()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        yield engine, client
    finally:
        client.close()
        server.stop()
        engine.shutdown()


@pytest.fixture
def oai(tiny_model, templated, tiny_model_dir):
    """(engine, client) of a server over the tiny model with the template above."""
    with openai_server(tiny_model, templated, tiny_model_dir) as served:
        yield served


def template_ids(tokenizer, messages, tools=None) -> list[int]:
    ids = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


def reference_top(model, prompt, output, k) -> list[list[float]]:
    """The k largest logprobs of each step of a full forward pass (T = 1)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    return logprobs.topk(k, dim=-1).values.tolist()


def test_models_list(oai, tiny_model_dir):
    engine, client = oai
    (model,) = client.models.list().data
    assert model.id == str(tiny_model_dir) and model.owned_by == "relayrl"
    assert model.model_extra["max_model_len"] == engine.max_seq_len


def test_chat_prompt_logprobs_and_top_logprobs(oai, tiny_model, templated):
    engine, client = oai
    parts = [{"type": "text", "text": "Start at 3. "}, {"type": "text", "text": "Add 4."}]
    answer = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}],
        max_completion_tokens=8,
        temperature=1.0,
        seed=5,
        n=2,
        logprobs=True,
        top_logprobs=3,
    )
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Start at 3. \nAdd 4."},  # parts joined as vLLM does
    ]
    prompt = template_ids(templated, messages)
    assert answer.model_extra["prompt_token_ids"] == prompt
    assert answer.model == "tiny" and len(answer.choices) == 2
    for i, choice in enumerate(answer.choices):
        ids = choice.model_extra["token_ids"]
        assert choice.index == i and 1 <= len(ids) <= 8
        assert choice.message.content == templated.decode(ids, skip_special_tokens=True)
        assert choice.model_extra["token_versions"] == [engine.weight_version] * len(ids)
        entries = choice.logprobs.content
        ref = recompute_logprobs(tiny_model, prompt, ids, 1.0)
        assert max(abs(e.logprob - r) for e, r in zip(entries, ref, strict=True)) < 1e-4
        for entry, top in zip(entries, reference_top(tiny_model, prompt, ids, 3), strict=True):
            got = [t.logprob for t in entry.top_logprobs]
            assert max(abs(a - b) for a, b in zip(got, top, strict=True)) < 1e-4
            assert entry.logprob <= got[0] + 1e-6
            assert entry.bytes == list(entry.token.encode())
    assert answer.choices[0].model_extra["token_ids"] != answer.choices[1].model_extra["token_ids"]
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.usage.completion_tokens == sum(
        len(c.model_extra["token_ids"]) for c in answer.choices
    )


def test_greedy_tokens_are_their_own_top_logprob(oai):
    _, client = oai
    answer = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Start at 1."}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=20,
    )
    for entry in answer.choices[0].logprobs.content:
        best = entry.top_logprobs[0]
        assert (best.token, best.logprob) == (entry.token, entry.logprob)
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 20 and values == sorted(values, reverse=True)


def _streamed(client, **request):
    """Per choice index: content, token ids, finish reason; and the usage chunk."""
    out: dict[int, dict] = {}
    usage, last_was_usage = None, False
    for chunk in client.chat.completions.create(stream=True, **request):
        if chunk.usage is not None:
            usage, last_was_usage = chunk.usage, True
            assert chunk.choices == []
            continue
        assert not last_was_usage, "the usage chunk comes last"
        for choice in chunk.choices:
            acc = out.setdefault(
                choice.index, {"content": "", "ids": [], "finish": None, "top": []}
            )
            acc["content"] += choice.delta.content or ""
            for entry in choice.logprobs.content if choice.logprobs else []:
                acc["top"].append([entry.logprob] + [t.logprob for t in entry.top_logprobs])
            acc["ids"] += choice.model_extra.get("token_ids", [])
            acc["finish"] = choice.finish_reason or acc["finish"]
    return out, usage


def test_streaming_equals_the_whole_answer(oai):
    _, client = oai
    request = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Start at 7. Steps: a +2."}],
        "max_tokens": 10,
        "seed": 11,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = client.chat.completions.create(**request)
    streamed, usage = _streamed(client, stream_options={"include_usage": True}, **request)
    assert sorted(streamed) == [0, 1]
    for choice in whole.choices:
        got = streamed[choice.index]
        assert got["ids"] == choice.model_extra["token_ids"]
        assert got["content"] == choice.message.content
        assert got["finish"] == choice.finish_reason
        whole_top = [
            [e.logprob] + [t.logprob for t in e.top_logprobs] for e in choice.logprobs.content
        ]
        assert got["top"] == whole_top and all(len(t) == 3 for t in whole_top)
    assert usage.completion_tokens == sum(len(s["ids"]) for s in streamed.values())
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_stop_string_is_cut_from_the_content(oai):
    _, client = oai
    request = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Start at 2. Steps: a *3."}],
        "max_tokens": 16,
        "temperature": 0,
    }
    free = client.chat.completions.create(**request).choices[0]
    text, ids = free.message.content, free.model_extra["token_ids"]
    assert len(text) >= 6, f"the greedy answer is too short to test a stop string: {text!r}"
    stop = text[3:5]
    cut = text.find(stop)
    stopped = client.chat.completions.create(stop=[stop], **request).choices[0]
    assert stopped.message.content == text[:cut] and stopped.finish_reason == "stop"
    # the returned tokens are every token generated, the stop string's included
    got = stopped.model_extra["token_ids"]
    assert got == ids[: len(got)] and stop in free.message.content[: len(_decode(oai, got))]
    streamed, _ = _streamed(client, stop=stop, **request)
    assert streamed[0]["content"] == text[:cut] and streamed[0]["ids"] == got


def tool_conversation(reply: str) -> tuple[dict, list[dict]]:
    """A user question, the assistant's call of the weather tool (``content: null``) and
    the tool's ``reply``: the call and the messages."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": json.dumps({"city": "Paris"})},
    }
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": reply},
    ]
    return call, messages


def _decode(oai, ids):
    return oai[0].tokenizer.decode(ids, skip_special_tokens=True)


def test_tool_conversation_is_rendered_by_the_template(oai, templated):
    _, client = oai
    call, messages = tool_conversation("sunny, 21 C")
    answer = client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER], tool_choice="auto", max_tokens=4, seed=0
    )
    as_template = [
        messages[0],
        {"role": "assistant", "content": "", "tool_calls": [_with_dict_args(call)]},
        messages[2],
    ]
    prompt = answer.model_extra["prompt_token_ids"]
    assert prompt == template_ids(templated, as_template, tools=[WEATHER])
    text = templated.decode(prompt)
    assert '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert '"name": "weather"' in text.split("<tools>")[1].split("</tools>")[0]
    assert "<tool_response>sunny, 21 C</tool_response>" in text


def _with_dict_args(call: dict) -> dict:
    function = {**call["function"], "arguments": json.loads(call["function"]["arguments"])}
    return {**call, "function": function}


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
        ({"extra_body": {"guided_regex": "a+"}}, "guided_regex"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages",
        ),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ],
)
def test_unsupported_fields_are_refused_by_name(oai, extra, named):
    _, client = oai
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**{**request, **extra})
    assert named in caught.value.message and named in caught.value.param
    assert caught.value.body["type"] == "invalid_request_error"


def test_neutral_values_of_unsupported_fields_pass(oai):
    _, client = oai
    answer = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "developer", "content": "x"}, {"role": "user", "content": "hi"}],
        max_tokens=2,
        frequency_penalty=0,
        presence_penalty=0,
        response_format={"type": "text"},
    )
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_text_completions_from_text_and_ids(oai, templated):
    _, client = oai
    text = "Start at 3. Steps: a +4."
    ids = templated(text)["input_ids"]
    by_text = client.completions.create(
        model="tiny", prompt=text, max_tokens=6, temperature=0, logprobs=2
    )
    by_ids = client.completions.create(model="tiny", prompt=[ids, ids], max_tokens=6, temperature=0)
    first = by_text.choices[0]
    assert first.model_extra["prompt_token_ids"] == ids and by_text.object == "text_completion"
    assert [c.index for c in by_ids.choices] == [0, 1]
    for choice in by_ids.choices:
        assert (
            choice.text == first.text
            and choice.model_extra["token_ids"] == first.model_extra["token_ids"]
        )
    assert len(first.logprobs.tokens) == len(first.model_extra["token_ids"])
    assert all(len(top) <= 2 for top in first.logprobs.top_logprobs)
    assert by_ids.usage.prompt_tokens == 2 * len(ids)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny", prompt=text, max_tokens=6, temperature=0, stream=True
        )
    )
    assert streamed == first.text


def test_closing_a_stream_aborts_its_request(oai):
    engine, client = oai
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=400,
        stream=True,
        extra_body={"ignore_eos": True},  # relayrl's (and vLLM's) extension
    )
    next(iter(stream))
    engine.pause("in_place")  # the request cannot finish by itself any more
    stream.close()
    deadline = time.monotonic() + 30
    while engine.stats()["num_requests"]:
        assert time.monotonic() < deadline, "the request outlived its closed stream"
        time.sleep(0.05)
    engine.continue_generation()
    stats = engine.stats()
    assert stats["aborted"] == 1 and stats["generated_tokens"] < 400


def test_the_documented_example_runs(oai):
    """docs/agents.md's client block, run as written against this server."""
    engine, client = oai
    text = (Path(__file__).resolve().parents[2] / "docs" / "agents.md").read_text()
    block = text.split("## An OpenAI-compatible endpoint", 1)[1].split("```python\n", 1)[1]
    block = block.split("```", 1)[0]
    assert "http://127.0.0.1:30000/v1" in block
    namespace: dict = {}
    exec(block.replace("http://127.0.0.1:30000/v1", str(client.base_url)), namespace)  # noqa: S102
    assert namespace["model"] == engine.model_path
    assert namespace["ids"] and namespace["answer"].choices[0].logprobs.content[0].top_logprobs
