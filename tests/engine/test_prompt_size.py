"""A huge text prompt never stalls the server (docs/security.md, admission limits): its
length is bounded by characters before anything is tokenized (a 400 naming the prompt), and
text is tokenized off the event loop, so ``GET /health`` keeps answering meanwhile. Before,
an 8 MB prompt was tokenized on the event loop and ``/health`` went unanswered for 69 s.

No timing threshold: the engine's tokenizer is replaced by one that records each call and
holds it until the test lets it go, so "refused before tokenizing" is "never called", and
"off the loop" is "``/health`` answers while a tokenization is held"."""

from __future__ import annotations

import threading

import httpx

from tests.engine.test_server import served  # noqa: F401 - the loopback server fixture

HOLD_LIMIT_S = 60.0  # a held tokenization is let go by then whatever happens


class HeldTokenizer:
    """The engine's tokenizer, whose encoding calls wait for :attr:`release`."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.entered = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        self.entered.set()
        self.release.wait(HOLD_LIMIT_S)
        return self.inner(*args, **kwargs)


def held_server(served):  # noqa: F811
    engine, url = served()
    held = HeldTokenizer(engine.tokenizer)
    engine.tokenizer = held
    return engine, url, held


def post_in_thread(url: str, body: dict) -> tuple[threading.Thread, list[httpx.Response]]:
    answer: list[httpx.Response] = []
    worker = threading.Thread(
        target=lambda: answer.append(httpx.post(url, json=body, timeout=2 * HOLD_LIMIT_S)),
        daemon=True,
    )
    worker.start()
    return worker, answer


def test_a_huge_text_prompt_is_refused_before_tokenizing(served):  # noqa: F811
    engine, url, held = held_server(served)
    held.release.set()  # a call would not wait: the test asserts there is none
    huge = "Start at 3. Steps: a +4. " * 80_000  # 2 MB: ~10 s to tokenize on this CPU

    answer = httpx.post(f"{url}/v1/completions", json={"prompt": huge, "max_tokens": 2}, timeout=60)
    assert answer.status_code == 400
    message = answer.json()["error"]["message"]
    assert message.startswith(f"prompt[0]: {len(huge)} characters cannot fit")

    chat = {"messages": [{"role": "user", "content": huge}], "max_tokens": 2}
    answer = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
    assert answer.status_code == 400 and "messages: " in answer.json()["error"]["message"]
    assert not held.entered.is_set()  # neither was tokenized


def test_a_prompt_within_the_character_bound_is_tokenized_off_the_loop(served):  # noqa: F811
    """At the bound the text is tokenized (in the tokenizing thread), then refused by its
    token count as before; ``/health`` answers while that tokenization is held; a short
    prompt is served."""
    from relayrl.engine.chat import max_token_chars

    engine, url, held = held_server(served)
    limit = engine.max_seq_len * max_token_chars(held.inner)
    text = ("Start at 3. Steps: a +4. " * (limit // 25 + 1))[:limit]

    worker, answer = post_in_thread(f"{url}/v1/completions", {"prompt": text, "max_tokens": 2})
    try:
        assert held.entered.wait(HOLD_LIMIT_S), "the prompt was never tokenized"
        # on the event loop, this probe could not be answered until the release
        assert httpx.get(f"{url}/health", timeout=HOLD_LIMIT_S / 4).status_code == 200
        assert worker.is_alive()  # the tokenization was still held when /health answered
    finally:
        held.release.set()
    worker.join(timeout=2 * HOLD_LIMIT_S)
    assert answer and answer[0].status_code == 400
    assert "characters" not in answer[0].json()["error"]["message"]
    ok = httpx.post(
        f"{url}/v1/completions", json={"prompt": "Start at 3.", "max_tokens": 2}, timeout=60
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"]
