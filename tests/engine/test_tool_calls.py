"""Tool calls parsed back from generated text (hermes and Llama 3 JSON formats), the format
picked from a chat template, and a tool-call answer streamed token by token through the
server's :class:`ChoiceText` with the tiny model's real tokenizer: no content delta ever
shows the call's markup, and the finished answer carries the parsed call; and a scripted
tool-call answer read by the official client, whole and streamed, in both formats."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from fastapi import FastAPI

from relayrl.engine.chat import ChoiceText, add_chat_route
from relayrl.engine.server import ServerThread
from relayrl.engine.tool_calls import (
    ToolCall,
    detect_formats,
    hold_back,
    parse_hermes,
    parse_llama3_json,
    parse_tool_calls,
)
from relayrl.engine.types import GenerationResult
from relayrl.models.loading import load_tokenizer
from tests.engine.test_openai_client import TEMPLATE, WEATHER

HERMES_TWO = (
    "Let me look.\n<tool_call>\n"
    '{"name": "weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
    '<tool_call>{"name": "time", "arguments": {}}</tool_call>'
)


def test_hermes_calls_and_content():
    content, calls = parse_hermes(HERMES_TWO)
    assert content == "Let me look."
    assert calls == [ToolCall("weather", {"city": "Paris", "days": 2}), ToolCall("time", {})]
    # an unclosed last call (the model stopped right after the JSON) still counts
    assert parse_hermes('<tool_call>{"name": "f", "arguments": {"x": 1}}') == (
        None,
        [ToolCall("f", {"x": 1})],
    )
    # arguments sent JSON-encoded are decoded
    assert parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')[1] == [
        ToolCall("f", {"x": 1})
    ]


@pytest.mark.parametrize(
    "text",
    [
        "no call here",
        '<tool_call>{"name": "f", "arguments": {</tool_call>',  # bad JSON
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
    ],
)
def test_malformed_hermes_stays_content(text):
    assert parse_hermes(text) == (text, [])


def test_llama3_json_calls():
    assert parse_llama3_json('{"name": "weather", "parameters": {"city": "Rome"}}') == (
        None,
        [ToolCall("weather", {"city": "Rome"})],
    )
    two = '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"k": "v"}}'
    assert parse_llama3_json(two)[1] == [ToolCall("a", {}), ToolCall("b", {"k": "v"})]
    for text in ("The answer is 4.", '{"name": "a", "parameters": {}} and more', '{"x": 1}'):
        assert parse_llama3_json(text) == (text, [])


def test_formats_from_the_template_and_in_order():
    assert detect_formats("... <tool_call>{{ c | tojson }}</tool_call> ...") == ("hermes",)
    assert detect_formats("<|python_tag|>{{ x }}") == ("llama3_json",)
    assert detect_formats('{"name": ..., "parameters": ...}') == ("llama3_json",)
    assert detect_formats(None) == ("hermes", "llama3_json")
    llama = '{"name": "a", "parameters": {"n": 1}}'
    assert parse_tool_calls(llama)[1] == [ToolCall("a", {"n": 1})]
    assert parse_tool_calls(llama, ("hermes",)) == (llama, [])
    call = ToolCall("a", {"n": "é"}).to_openai("call_x")
    assert call == {
        "id": "call_x",
        "type": "function",
        "function": {"name": "a", "arguments": '{"n": "é"}'},
    }
    assert json.loads(call["function"]["arguments"]) == {"n": "é"}


def test_hold_back_keeps_what_may_become_a_call():
    hermes = ("hermes",)
    assert hold_back("Let me look.", hermes) == len("Let me look.")
    assert hold_back("Let me look.<tool", hermes) == len("Let me look.")
    assert hold_back("Let me look.<tool_call>{", hermes) == len("Let me look.")
    assert hold_back("a <", hermes) == 2 and hold_back("a < b", hermes) == 5  # "<" may start a call
    llama = ("llama3_json",)
    assert hold_back('  {"name"', llama) == 0 and hold_back("<|python", llama) == 0
    assert hold_back("The answer", llama) == len("The answer")


def test_a_streamed_tool_call_never_shows_its_markup(tiny_tokenizer):
    ids = tiny_tokenizer(HERMES_TWO, add_special_tokens=False)["input_ids"]
    choice = ChoiceText(tiny_tokenizer, stops=[], tool_formats=("hermes",))
    streamed = ""
    for tok in ids:
        choice.add(tok, -0.5, 0, [])
        delta = choice.delta()
        assert "<" not in delta
        streamed += delta
    content, calls = choice.final()
    assert streamed == "Let me look.\n" and content == "Let me look."
    assert [c["function"]["name"] for c in calls] == ["weather", "time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 2}
    assert choice.delta(final=content) == ""  # nothing left to stream but the calls
    choice.one_call = True  # parallel_tool_calls: false
    assert [c["function"]["name"] for c in choice.final()[1]] == ["weather"]


def test_a_stop_string_is_never_streamed(tiny_tokenizer):
    text = "Start at 3. Answer: 7 END of it"
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    choice = ChoiceText(tiny_tokenizer, stops=[" END"], tool_formats=None)
    streamed = ""
    for tok in ids:
        choice.add(tok, -0.5, 0, [])
        streamed += choice.delta()
    assert streamed == "Start at 3. Answer: 7" == choice.final()[0]


class ScriptedEngine:
    """The engine's side of ``/v1`` with a scripted answer: the tiny tokenizer's ids of
    ``text`` then EOS, handed over token by token as the real engine does. A random model
    cannot be made to call a tool; this checks the wire shape of a call the model made."""

    def __init__(self, tokenizer, text: str) -> None:
        self.tokenizer, self.model_path, self.max_seq_len = tokenizer, "scripted", 512
        self.ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        self.ids.append(tokenizer.eos_token_id)

    def validate(self, prompt, params) -> None:
        params.validate()

    async def generate(self, prompt, params, rid=None, on_token=None, top_logprobs=0):
        for tok in self.ids:
            if on_token is not None:
                on_token(tok, -0.5, 3, [])
            await asyncio.sleep(0)
        n = len(self.ids)
        eos = self.ids[-1]
        return GenerationResult(
            "r", prompt, self.ids, [-0.5] * n, [3] * n, "stop", len(prompt), matched_stop=eos
        )


@pytest.fixture
def scripted(tiny_model_dir):
    servers = []

    def start(text: str, template: str) -> openai.OpenAI:
        tokenizer = load_tokenizer(tiny_model_dir)
        tokenizer.chat_template = template
        app = FastAPI()
        add_chat_route(app, ScriptedEngine(tokenizer, text))
        servers.append(ServerThread(app).start())
        return openai.OpenAI(base_url=f"{servers[-1].url}/v1", api_key="x", max_retries=0)

    yield start
    for server in servers:
        server.stop()


LLAMA_TEMPLATE = (  # detected as llama3_json; renders the tools (the server refuses otherwise)
    "{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}<|python_tag|>"
)


@pytest.mark.parametrize(
    ("text", "template", "content"),
    [
        (HERMES_TWO, TEMPLATE, "Let me look."),
        (
            '{"name": "weather", "parameters": {"city": "Paris", "days": 2}}; {"name": "time", "parameters": {}}',
            LLAMA_TEMPLATE,
            None,
        ),
    ],
)
def test_a_tool_call_answer_on_the_wire(scripted, text, template, content):
    client = scripted(text, template)
    request = {
        "model": "m",
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [WEATHER],
    }
    whole = client.chat.completions.create(**request).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == content
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert calls == [("weather", {"city": "Paris", "days": 2}), ("time", {})]
    assert whole.model_extra["token_versions"] == [3] * len(whole.model_extra["token_ids"])
    streamed_text, streamed_calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            streamed_text += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = streamed_calls.setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert "<tool_call>" not in streamed_text and streamed_text.strip() == (content or "")
    assert [
        (n, json.loads(a)) for n, a in streamed_calls.values()
    ] == calls and finish == "tool_calls"
    # tool_choice "none": the same answer is plain content
    plain = client.chat.completions.create(tool_choice="none", **request).choices[0]
    assert plain.message.tool_calls is None and plain.message.content == text
    assert plain.finish_reason == "stop"
