"""The OpenAI-compatible ``/v1`` endpoints of the built-in server, so agent code written
against an OpenAI client can drive relayrl's engine: ``GET /v1/models``,
``POST /v1/chat/completions`` and ``POST /v1/completions``, answered whole or streamed as
server-sent events (``stream: true``; ``stream_options.include_usage`` adds a last chunk
with the usage).

Owns :func:`add_chat_route` (mounts the three routes), :class:`ChoiceText` (one choice's
tokens, its content so far, and what of it may already be streamed) and the answer shapes.
The requests, their errors and the chat rendering are ``relayrl.engine.openai_api``'s; the
tool-call formats ``relayrl.engine.tool_calls``'.

As OpenAI: a ``stop`` string ends the content and is not part of it; with ``tools``, an
answer in the model's tool-call format comes back as ``message.tool_calls`` with
``finish_reason: "tool_calls"``; ``logprobs.content[i].top_logprobs`` are the engine's
``top_logprobs`` most likely tokens at that step. Besides the OpenAI fields the answer
carries what training needs, as vLLM does with ``return_token_ids``: ``prompt_token_ids``
and, per choice (and per streamed chunk), ``token_ids`` and ``token_versions`` (the weight
version of each token), every generated token included (a matched stop string's too);
``logprob`` is the behaviour logprob of ``token_ids[i]`` (temperature-scaled, like
``/generate``). A request aborted by a weight update ends with ``finish_reason: "abort"``.

Text is tokenized off the event loop (one tokenizing thread per process, :data:`TOKENIZE`:
fast tokenizers are not safe to call from several threads at once), after a cheap bound on
its length (:func:`check_text_size`: more characters than the context's tokens can spell is
a 400 before anything is tokenized), so a huge prompt never stalls ``/health`` or other
requests (an 8 MB prompt held the loop for 69 s before).

Imports: fastapi/starlette, the engine's plain types, relayrl.engine (openai_api, tool_calls).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from relayrl.engine.limits import await_or_disconnect
from relayrl.engine.openai_api import (
    ChatIn,
    CompletionIn,
    OpenAIError,
    parse_body,
    prompts_of,
    render_chat,
)
from relayrl.engine.tool_calls import detect_formats, hold_back, parse_tool_calls, partial_suffix
from relayrl.engine.types import GenerationResult, SamplingParams


@dataclass
class Job:
    """One choice to generate: its index in the answer, prompt, sampling parameters and how
    many alternatives of each token to report."""

    index: int
    prompt: list[int]
    params: SamplingParams
    top: int = 0


@dataclass
class ChoiceText:
    """One choice's tokens as they arrive, and the content they decode to."""

    tokenizer: Any
    stops: list[str]
    tool_formats: tuple[str, ...] | None  # None: the answer is not parsed for tool calls
    one_call: bool = False  # parallel_tool_calls: false keeps the first call only
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    sent: int = 0  # characters of content already streamed

    def add(self, token: int, logprob: float, version: int, top: list[tuple[int, float]]) -> None:
        self.ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        self.tops.append(top)

    def catch_up(self, result: GenerationResult) -> int:
        """Take the tokens of ``result`` not seen yet; the index of the first new one."""
        start = len(self.ids)
        tops = result.output_top_logprobs or [[] for _ in result.output_ids]
        for i in range(start, len(result.output_ids)):
            self.add(
                result.output_ids[i], result.output_logprobs[i], result.output_versions[i], tops[i]
            )
        return start

    def text(self) -> str:
        """The content so far: special tokens skipped, cut at the first stop string."""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cuts = [text.find(s) for s in self.stops if s in text]
        return text[: min(cuts)] if cuts else text

    def streamable(self) -> str:
        """The part of the content that no later token can change: not an unfinished
        character, not what may become a stop string or a tool call."""
        text = self.text()
        safe = len(text.rstrip("\ufffd"))
        for stop in self.stops:
            safe = min(safe, len(text) - partial_suffix(text, stop))
        if self.tool_formats is not None:
            safe = min(safe, hold_back(text, self.tool_formats))
        return text[: max(safe, 0)]

    def delta(self, final: str | None = None) -> str:
        """Content not streamed yet (all of ``final``'s rest when given)."""
        text = self.streamable() if final is None else final
        if len(text) <= self.sent:
            return ""
        out, self.sent = text[self.sent :], len(text)
        return out

    def final(self) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of the finished choice."""
        text = self.text()
        if self.tool_formats is None:
            return text, []
        content, calls = parse_tool_calls(text, self.tool_formats)
        calls = calls[:1] if self.one_call else calls
        return content, [call.to_openai() for call in calls]


def _finish_reason(result: GenerationResult, tool_calls: list) -> str:
    if tool_calls and result.finish_reason == "stop":
        return "tool_calls"
    return {"stop": "stop", "length": "length"}.get(result.finish_reason, "abort")


def _token_entry(tokenizer, token: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.decode([token])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(choice: ChoiceText, start: int, end: int) -> dict[str, Any]:
    """OpenAI's chat ``logprobs`` of tokens ``start:end``: each token and its alternatives."""
    tok = choice.tokenizer
    content = []
    for i in range(start, end):
        entry = _token_entry(tok, choice.ids[i], choice.logprobs[i])
        entry["top_logprobs"] = [_token_entry(tok, t, lp) for t, lp in choice.tops[i]]
        content.append(entry)
    return {"content": content}


def completion_logprobs(choice: ChoiceText, start: int, end: int, offset: int) -> dict[str, Any]:
    """The legacy completions ``logprobs``: tokens, their logprobs, alternatives, offsets."""
    tok = choice.tokenizer
    tokens = [tok.decode([t]) for t in choice.ids[start:end]]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": choice.logprobs[start:end],
        "top_logprobs": [{tok.decode([t]): lp for t, lp in top} for top in choice.tops[start:end]],
        "text_offset": offsets,
    }


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class Endpoint:
    """What differs between chat and text completions: the body, its jobs and shapes."""

    chat: bool
    body: Any
    prompts: list[list[int]]
    jobs: list[Job]
    model: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def head(self, streaming: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        prefix = "chatcmpl" if self.chat else "cmpl"
        return {
            "id": f"{prefix}-{self.id}",
            "object": kind + (".chunk" if streaming and self.chat else ""),
            "created": self.created,
            "model": self.model,
        }

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def wants_logprobs(self) -> bool:
        return bool(self.body.logprobs) if self.chat else self.body.logprobs is not None

    def choice_text(self, tokenizer) -> ChoiceText:
        stops = [self.body.stop] if isinstance(self.body.stop, str) else list(self.body.stop or [])
        formats = None
        if self.chat and self.body.parse_tools:
            formats = detect_formats(getattr(tokenizer, "chat_template", None))
        return ChoiceText(
            tokenizer, stops, formats, one_call=self.chat and not self.body.parallel_tool_calls
        )

    def logprobs(self, choice: ChoiceText, start: int, end: int) -> dict[str, Any] | None:
        if not self.wants_logprobs():
            return None
        if self.chat:
            return chat_logprobs(choice, start, end)
        offset = len(choice.tokenizer.decode(choice.ids[:start], skip_special_tokens=True))
        return completion_logprobs(choice, start, end, offset)


def _full_choice(ep: Endpoint, job: Job, choice: ChoiceText, result: GenerationResult) -> dict:
    choice.catch_up(result)
    content, calls = choice.final()
    out: dict[str, Any] = {"index": job.index}
    if ep.chat:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        out["message"] = message
    else:
        out["text"] = content
        out["prompt_token_ids"] = job.prompt
    out["logprobs"] = ep.logprobs(choice, 0, len(choice.ids))
    out["finish_reason"] = _finish_reason(result, calls)
    out["token_ids"] = list(result.output_ids)
    out["token_versions"] = list(result.output_versions)
    return out


def full_answer(ep: Endpoint, tokenizer, results: list[GenerationResult]) -> dict[str, Any]:
    """The whole (non-streamed) answer of an endpoint's jobs."""
    choices = [
        _full_choice(ep, job, ep.choice_text(tokenizer), result)
        for job, result in zip(ep.jobs, results, strict=True)
    ]
    answer = {
        **ep.head(streaming=False),
        "choices": choices,
        "usage": _usage(ep.prompt_tokens, sum(len(r.output_ids) for r in results)),
    }
    if ep.chat:
        answer["prompt_token_ids"] = ep.jobs[0].prompt
    return answer


# ---------------------------------------------------------------- streaming (server-sent events)
def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _chunk(ep: Endpoint, index: int, delta: dict[str, Any] | str, **fields: Any) -> dict:
    """One streamed chunk of one choice (``delta``: chat's delta or the completion's text)."""
    choice: dict[str, Any] = {"index": index}
    choice["delta" if ep.chat else "text"] = delta
    choice.update({"logprobs": None, "finish_reason": None, **fields})
    return {**ep.head(streaming=True), "choices": [choice]}


def _token_chunk(
    ep: Endpoint, job: Job, choice: ChoiceText, start: int, reason: GenerationResult | None = None
) -> dict[str, Any]:
    """The chunk of ``choice``'s tokens from ``start``: their content delta, logprobs and
    ids; ``reason`` set: the last chunk (the rest of the content, any tool calls)."""
    calls: list[dict[str, Any]] = []
    if reason is None:
        text = choice.delta()
    else:
        content, calls = choice.final()
        text = choice.delta(final=content or "")
    delta: dict[str, Any] | str = text
    if ep.chat:
        delta = {"content": text} if text or not calls else {}
        if calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
    end = len(choice.ids)
    fields = {
        "logprobs": ep.logprobs(choice, start, end) if end > start else None,
        "finish_reason": None if reason is None else _finish_reason(reason, calls),
        "token_ids": choice.ids[start:end],
        "token_versions": choice.versions[start:end],
    }
    return _chunk(ep, job.index, delta, **fields)


class _Events:
    """Tokens and finished requests of a streamed answer, in the order the engine made them:
    the engine's loop thread hands each token over with ``call_soon_threadsafe``, before the
    request's result (set after its last token) reaches the event loop."""

    def __init__(self, ep: Endpoint, engine) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks = [self._start(k, job, engine) for k, job in enumerate(ep.jobs)]

    def _start(self, k: int, job: Job, engine) -> asyncio.Task:
        def on_token(token: int, logprob: float, version: int, top: list) -> None:
            try:
                self.loop.call_soon_threadsafe(
                    self.queue.put_nowait, (k, (token, logprob, version, top))
                )
            except RuntimeError:  # the event loop is closed: nobody is listening
                pass

        task = asyncio.ensure_future(
            engine.generate(job.prompt, job.params, on_token=on_token, top_logprobs=job.top)
        )
        task.add_done_callback(lambda done: self.queue.put_nowait((k, done)))
        return task

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()


async def stream_answer(ep: Endpoint, engine) -> AsyncIterator[str]:
    """The answer as server-sent events; a client that goes away aborts its requests."""
    choices = [ep.choice_text(engine.tokenizer) for _ in ep.jobs]
    events, left, completion = _Events(ep, engine), set(range(len(ep.jobs))), 0
    try:
        if ep.chat:
            for job in ep.jobs:
                first = _chunk(ep, job.index, {"role": "assistant", "content": ""})
                yield _sse({**first, "prompt_token_ids": job.prompt})
        while left:
            k, item = await events.queue.get()
            if k not in left:
                continue
            choice, job = choices[k], ep.jobs[k]
            if isinstance(item, tuple):
                choice.add(*item)
                yield _sse(_token_chunk(ep, job, choice, len(choice.ids) - 1))
                continue
            result: GenerationResult = item.result()
            start = choice.catch_up(result)
            left.discard(k)
            completion += len(result.output_ids)
            yield _sse(_token_chunk(ep, job, choice, start, reason=result))
        if ep.body.include_usage:
            usage = {
                **ep.head(streaming=True),
                "choices": [],
                "usage": _usage(ep.prompt_tokens, completion),
            }
            yield _sse(usage)
        yield "data: [DONE]\n\n"
    except Exception as exc:  # noqa: BLE001 - the stream has started: the error is an event
        yield _sse(OpenAIError(f"generation failed: {exc}", status=500).body())
    finally:
        events.cancel()


# ---------------------------------------------------------------- the routes
DEFAULT_MAX_TOKENS = 128  # chat without max_tokens: this, or what the context has left


def _job(engine, body: Any, prompt: list[int], index: int, chat: bool) -> Job:
    """Choice ``index`` of ``prompt``, its parameters checked by the engine."""
    if chat:
        asked = body.max_completion_tokens or body.max_tokens
        room = max(1, engine.max_seq_len - len(prompt))
        max_tokens = asked or min(DEFAULT_MAX_TOKENS, room)
        top = (body.top_logprobs or 0) if body.logprobs else 0
    else:
        max_tokens, top = body.max_tokens, body.logprobs or 0
    params = body.sampling(index % body.n, max_tokens)
    try:
        engine.validate(prompt, params)
    except ValueError as exc:
        message = str(exc).replace("max_new_tokens", "max_tokens")
        message = message.replace("len(input_ids)", "the prompt's tokens")
        message = message.replace("input_ids", "messages" if chat else "prompt")
        param = "max_tokens" if "max_tokens" in message else None
        raise OpenAIError(message, param) from None
    return Job(index, prompt, params, top)


TOKENIZE = ThreadPoolExecutor(1, thread_name_prefix="relayrl-tokenize")
FALLBACK_TOKEN_CHARS = 64  # a tokenizer without a readable vocabulary
_token_chars: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def max_token_chars(tokenizer) -> int:
    """The most characters one token of ``tokenizer`` spells (its longest vocabulary entry;
    byte-level vocabularies write each byte as one character), so a text of more than
    ``n * max_token_chars`` characters has more than ``n`` tokens. Computed once."""
    try:
        return _token_chars[tokenizer]
    except (KeyError, TypeError):
        pass
    vocab = getattr(tokenizer, "get_vocab", None)
    longest = max(map(len, vocab()), default=1) if callable(vocab) else FALLBACK_TOKEN_CHARS
    try:
        _token_chars[tokenizer] = max(1, longest)
    except TypeError:
        pass
    return max(1, longest)


def _prompt_texts(body: Any, chat: bool) -> list[tuple[str, int]]:
    """(field, characters) of each text prompt of ``body`` (a chat's messages count as one)."""
    if chat:
        return [("messages", sum(len(m.text()) for m in body.messages))]
    items = body.prompt if isinstance(body.prompt, list) else [body.prompt]
    return [(f"prompt[{i}]", len(t)) for i, t in enumerate(items) if isinstance(t, str)]


def check_text_size(engine, body: Any, chat: bool) -> None:
    """:class:`OpenAIError` for a text prompt too long to fit the context whatever it
    tokenizes to (more characters than ``max_seq_len`` tokens can spell), before it is
    tokenized."""
    limit = engine.max_seq_len * max_token_chars(engine.tokenizer)
    for name, chars in _prompt_texts(body, chat):
        if chars > limit:
            raise OpenAIError(
                f"{name}: {chars} characters cannot fit this server's context of "
                f"{engine.max_seq_len} tokens (at most {limit} characters)",
                name.split("[")[0],
            )


def make_endpoint(engine, data: Any, chat: bool) -> Endpoint:
    """The validated request: its prompts and one job per choice; :class:`OpenAIError`.
    Tokenizes: call it off the event loop (:func:`endpoint_of`)."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise OpenAIError("this server has no tokenizer; use /generate with token ids")
    if chat:
        body = parse_body(ChatIn, data).checked()
        check_text_size(engine, body, chat)
        prompts = [render_chat(tokenizer, body)]
    else:
        body = parse_body(CompletionIn, data).checked()
        check_text_size(engine, body, chat)
        prompts = prompts_of(tokenizer, body)
    jobs = [
        _job(engine, body, prompt, p * body.n + i, chat)
        for p, prompt in enumerate(prompts)
        for i in range(body.n)
    ]
    model = body.model or served_model(engine)
    return Endpoint(chat, body, prompts, jobs, model)


def served_model(engine) -> str:
    return str(engine.model_path) if engine.model_path else "relayrl"


def error_response(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(status_code=exc.status, content=exc.body())


async def json_body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise OpenAIError(f"body: malformed JSON ({exc})") from None


async def endpoint_of(request: Request, engine, chat: bool) -> Endpoint:
    """:func:`make_endpoint` of the request's body, in the tokenizing thread."""
    data = await json_body(request)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(TOKENIZE, make_endpoint, engine, data, chat)


async def _answer(request: Request, engine, chat: bool):
    try:
        ep = await endpoint_of(request, engine, chat)
    except OpenAIError as exc:
        return error_response(exc)
    if ep.body.stream:
        return StreamingResponse(stream_answer(ep, engine), media_type="text/event-stream")
    results = await generate_jobs(request, engine, ep.jobs)
    if isinstance(results, JSONResponse):
        return results
    return JSONResponse(full_answer(ep, engine.tokenizer, results))


async def generate_jobs(
    request: Request, engine, jobs: list[Job]
) -> list[GenerationResult] | JSONResponse:
    """Every job's result, in order; the error answer if the client went away (its requests
    are aborted) or the engine refused one."""
    task = asyncio.gather(
        *(engine.generate(job.prompt, job.params, top_logprobs=job.top) for job in jobs)
    )
    if not await await_or_disconnect(request, task):
        return error_response(OpenAIError("client disconnected", status=499))
    try:
        return task.result()
    except ValueError as exc:
        return error_response(OpenAIError(str(exc)))


def add_chat_route(app: FastAPI, engine) -> None:
    """Serve ``GET /v1/models``, ``POST /v1/chat/completions`` and ``POST /v1/completions``
    from ``engine`` (the completions need its tokenizer)."""

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = {
            "id": served_model(engine),
            "object": "model",
            "created": 0,
            "owned_by": "relayrl",
            "max_model_len": engine.max_seq_len,
        }
        return {"object": "list", "data": [model]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _answer(request, engine, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _answer(request, engine, chat=False)
