"""A huge text prompt never stalls the server (docs/security.md, admission limits): its
length is bounded by characters before anything is tokenized (a 400 naming the prompt), and
text is tokenized off the event loop, so ``GET /health`` keeps answering meanwhile. Before,
an 8 MB prompt was tokenized on the event loop and ``/health`` went unanswered for 69 s."""

from __future__ import annotations

import threading
import time

import httpx

from tests.engine.test_server import served  # noqa: F401 - the loopback server fixture

HEALTH_DEADLINE_S = 2.0


def health_while(url: str, request) -> tuple[httpx.Response, float]:
    """Send ``request()`` in a thread; probe ``/health`` every 50 ms until it answers.
    Returns its answer and the longest a probe took (a probe past the deadline fails)."""
    answer: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: answer.append(request()), daemon=True)
    worker.start()
    slowest, deadline = 0.0, time.monotonic() + 120
    while worker.is_alive():
        assert time.monotonic() < deadline, "the huge request did not end within 120 s"
        start = time.monotonic()
        probe = httpx.get(f"{url}/health", timeout=HEALTH_DEADLINE_S)
        assert probe.status_code == 200
        slowest = max(slowest, time.monotonic() - start)
        time.sleep(0.05)
    worker.join(timeout=5)
    return answer[0], slowest


def test_a_huge_text_prompt_is_refused_before_tokenizing_and_health_answers(served):  # noqa: F811
    engine, url = served()
    huge = "Start at 3. Steps: a +4. " * 80_000  # 2 MB: ~10 s to tokenize on this CPU

    def send() -> httpx.Response:
        body = {"prompt": huge, "max_tokens": 2}
        return httpx.post(f"{url}/v1/completions", json=body, timeout=120)

    start = time.monotonic()
    answer, slowest = health_while(url, send)
    assert answer.status_code == 400
    message = answer.json()["error"]["message"]
    assert message.startswith(f"prompt[0]: {len(huge)} characters cannot fit")
    assert time.monotonic() - start < 5.0  # refused by its length, not after tokenizing
    assert slowest < HEALTH_DEADLINE_S

    chat = {"messages": [{"role": "user", "content": huge}], "max_tokens": 2}
    answer = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
    assert answer.status_code == 400 and "messages: " in answer.json()["error"]["message"]


def test_a_prompt_within_the_character_bound_is_tokenized_off_the_loop(served):  # noqa: F811
    """At the bound the text is tokenized (in the tokenizing thread), then refused by its
    token count as before; a short prompt is served."""
    from relayrl.engine.chat import max_token_chars

    engine, url = served()
    limit = engine.max_seq_len * max_token_chars(engine.tokenizer)
    text = ("Start at 3. Steps: a +4. " * (limit // 25 + 1))[:limit]

    def send() -> httpx.Response:
        return httpx.post(
            f"{url}/v1/completions", json={"prompt": text, "max_tokens": 2}, timeout=60
        )

    answer, slowest = health_while(url, send)
    assert answer.status_code == 400 and "characters" not in answer.json()["error"]["message"]
    assert slowest < HEALTH_DEADLINE_S
    ok = httpx.post(
        f"{url}/v1/completions", json={"prompt": "Start at 3.", "max_tokens": 2}, timeout=60
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"]
