"""``tools`` on a model whose chat template cannot show them: SmolLM2's ChatML template
(the tiny GGUF's, ``tests/models/tiny_gguf.py``) renders neither ``tools`` nor an
assistant turn's ``tool_calls``. The built-in server sent such a conversation to the model
without them and answered 200 as if the model had seen them; now it is a 400 naming the
field, through the official ``openai`` client over a loopback server. The same conversation
without tools is still served, and a template that renders tools still takes them
(tests/engine/test_openai_client.py)."""

from __future__ import annotations

import openai
import pytest

from relayrl.engine.openai_api import ChatIn, OpenAIError, render_chat
from relayrl.models.loading import load_tokenizer
from tests.engine.test_openai_client import TEMPLATE as TOOLS_TEMPLATE
from tests.engine.test_openai_client import WEATHER, openai_server, tool_conversation
from tests.models.tiny_gguf import CHAT_TEMPLATE as CHATML


@pytest.fixture
def chatml(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.chat_template = CHATML
    return tokenizer


@pytest.fixture
def client(tiny_model, chatml, tiny_model_dir):
    with openai_server(tiny_model, chatml, tiny_model_dir) as (_, client):
        yield client


QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


def test_tools_the_template_drops_are_a_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny", messages=QUESTION, tools=[WEATHER], max_tokens=4
        )
    error = caught.value.body
    assert error["param"] == "tools" and error["code"] == "unsupported_value"
    assert "chat template does not render tools" in error["message"]
    # the same conversation without tools is served
    answer = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_tool_calls_the_template_drops_are_a_400(client):
    _, messages = tool_conversation("sunny, 21 C")
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    assert caught.value.body["param"] == "messages[1].tool_calls"
    assert "does not render tool calls" in caught.value.body["message"]


def test_a_template_that_renders_tools_still_takes_them(chatml):
    _, messages = tool_conversation("sunny, 21 C")
    body = ChatIn.model_validate({"messages": messages, "tools": [WEATHER]}).checked()
    with pytest.raises(OpenAIError):
        render_chat(chatml, body)
    chatml.chat_template = TOOLS_TEMPLATE
    text = chatml.decode(render_chat(chatml, body))
    assert '"name": "weather"' in text and "<tool_call>" in text
