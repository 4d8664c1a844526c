"""An OpenAI-compatible ``/v1/chat/completions`` on the built-in server, so agent code
written against an OpenAI client can drive relayrl's engine.

Owns: :class:`ChatIn` (the request: ``messages``, ``max_tokens`` / ``max_completion_tokens``,
``temperature``, ``top_p``, ``n``, ``seed``, ``stop``, ``logprobs``), :func:`render_messages`
(messages → prompt token ids) and :func:`add_chat_route`. Besides the OpenAI fields the
answer carries what training needs, as vLLM does with ``return_token_ids``:
``prompt_token_ids`` and, per choice, ``token_ids`` and ``token_versions`` (the weight
version of each token); ``logprobs.content[i].logprob`` is the behaviour logprob of
``token_ids[i]`` (temperature-scaled, like ``/generate``).

Rendering: with a chat template, the tokenizer's; without one (the task tokenizers), the
first user message in the plain template (``relayrl.models.loading.encode_prompt``) and
every later message's content appended as it is, which is exactly the token layout of an
episode (prompt, model turn, observation, model turn; docs/agents.md).

Imports: fastapi/pydantic, the engine's plain types, relayrl.models.loading.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from relayrl.engine.types import GenerationResult, SamplingParams
from relayrl.models.loading import encode_prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... are accepted

    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatIn(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use

    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=64)
    seed: int | None = None
    stop: str | list[str] | None = None
    logprobs: bool = False
    stream: Literal[False] = False

    def sampling(self, index: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        seed = None if self.seed is None else self.seed + index
        return SamplingParams(
            max_new_tokens=self.max_completion_tokens or self.max_tokens or 128,
            temperature=self.temperature,
            top_p=self.top_p,
            stop=stop,
            seed=seed,
        )


def render_messages(tokenizer, messages: list[ChatMessage]) -> list[int]:
    """Prompt token ids of a conversation, ready for the assistant's next turn."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=True,
            tokenize=False,
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    head = [m.content for m in messages if m.role == "system"]
    rest = [m for m in messages if m.role != "system"]
    if not rest or rest[0].role != "user":
        raise ValueError("messages: the first non-system message must be the user's")
    ids = encode_prompt(tokenizer, "\n".join([*head, rest[0].content]))
    for message in rest[1:]:
        ids += tokenizer(message.content, add_special_tokens=False)["input_ids"]
    return ids


def _choice(tokenizer, index: int, result: GenerationResult, logprobs: bool) -> dict[str, Any]:
    reason = {"stop": "stop", "length": "length"}.get(result.finish_reason, "abort")
    choice: dict[str, Any] = {
        "index": index,
        "message": {
            "role": "assistant",
            "content": tokenizer.decode(result.output_ids, skip_special_tokens=True),
        },
        "finish_reason": reason,
        "token_ids": list(result.output_ids),
        "token_versions": list(result.output_versions),
        "logprobs": None,
    }
    if logprobs:
        choice["logprobs"] = {
            "content": [
                {"token": tokenizer.decode([tok]), "logprob": lp, "top_logprobs": []}
                for tok, lp in zip(result.output_ids, result.output_logprobs, strict=True)
            ]
        }
    return choice


def add_chat_route(app: FastAPI, engine) -> None:
    """Serve ``POST /v1/chat/completions`` from ``engine`` (which needs a tokenizer)."""

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatIn):
        tokenizer = engine.tokenizer
        if tokenizer is None:
            return _chat_error(400, "this server has no tokenizer; use /generate with ids")
        try:
            prompt = render_messages(tokenizer, body.messages)
            params = [body.sampling(i) for i in range(body.n)]
            for p in params:
                engine.validate(prompt, p)
        except ValueError as exc:
            return _chat_error(400, str(exc))
        results = await asyncio.gather(*(engine.generate(prompt, p) for p in params))
        completion = sum(len(r.output_ids) for r in results)
        return JSONResponse(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.model or str(engine.model_path),
                "choices": [_choice(tokenizer, i, r, body.logprobs) for i, r in enumerate(results)],
                "usage": {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": completion,
                    "total_tokens": len(prompt) + completion,
                },
                "prompt_token_ids": prompt,
            }
        )


def _chat_error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": "invalid_request_error"}},
    )
