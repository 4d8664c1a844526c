"""The OpenAI-compatible ``/v1/chat/completions`` of the built-in server, over a real
loopback server: the answer's token ids decode to its content, its logprobs are the policy's
(recomputed by a full forward pass), every token has the server's weight version, a
multi-message conversation is rendered as an episode's token layout, and bad requests get
a 400 naming the problem."""

from __future__ import annotations

import httpx

from relayrl.models.loading import encode_prompt
from tests.engine.conftest import recompute_logprobs
from tests.engine.test_server import served  # noqa: F401 - the loopback server fixture


def test_chat_completion_returns_ids_logprobs_and_versions(
    served,  # noqa: F811
    tiny_model,
    tiny_tokenizer,
):
    engine, url = served()
    messages = [
        {"role": "user", "content": "Start at 3. Steps: a +4. What is the result?"},
        {"role": "assistant", "content": "a 3+4=7"},
        {"role": "tool", "content": "\n"},
    ]
    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 3,
        "n": 2,
        "logprobs": True,
    }
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    prompt = encode_prompt(tiny_tokenizer, messages[0]["content"])
    for text in ("a 3+4=7", "\n"):
        prompt += tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert answer["object"] == "chat.completion" and answer["prompt_token_ids"] == prompt
    assert len(answer["choices"]) == 2
    for choice in answer["choices"]:
        ids = choice["token_ids"]
        assert 1 <= len(ids) <= 12
        assert choice["message"]["content"] == tiny_tokenizer.decode(ids, skip_special_tokens=True)
        assert choice["token_versions"] == [engine.weight_version] * len(ids)
        logprobs = [c["logprob"] for c in choice["logprobs"]["content"]]
        ref = recompute_logprobs(tiny_model, prompt, ids, 1.0)
        assert max(abs(a - b) for a, b in zip(ref, logprobs, strict=True)) < 1e-4
    usage = answer["usage"]
    assert usage["prompt_tokens"] == len(prompt)
    assert usage["completion_tokens"] == sum(len(c["token_ids"]) for c in answer["choices"])


def test_chat_bad_requests_get_400(served):  # noqa: F811
    _, url = served()
    no_user = {"messages": [{"role": "assistant", "content": "hi"}]}
    answer = httpx.post(f"{url}/v1/chat/completions", json=no_user, timeout=30)
    assert answer.status_code == 400
    assert "first non-system message must be the user's" in answer.json()["error"]["message"]
    empty = httpx.post(f"{url}/v1/chat/completions", json={"messages": []}, timeout=30)
    assert empty.status_code == 400 and "messages" in empty.json()["error"]["message"]
