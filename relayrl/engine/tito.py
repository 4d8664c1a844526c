"""vLLM's token-in, token-out route on the built-in server: ``POST /inference/v1/generate``.

A client that renders its prompts itself posts token ids and vLLM's sampling parameters and
reads token ids and logprobs back, with no text on either side. verifiers' training client
does (through the ``renderers`` package: ``{"model", "token_ids", "sampling_params"}``, the
answer's ``choices[0].token_ids``, ``.logprobs.content[i].logprob`` and ``.finish_reason``),
and so does relayrl's own vLLM client (``relayrl.engine.vllm_client``), which also reads
``choices[i].weight_versions``, the spans of output tokens each weight version produced (the
guard plugin's extension on a vLLM server; here from the engine's per-token versions).

Owns :class:`TitoIn` (the request; vLLM's ``SamplingParams`` fields as :class:`TitoSampling`,
the ones the built-in engine does not implement accepted at their neutral value only, any
other a 400 naming it) and :func:`add_tito_route`. Errors are OpenAI's shape
(``relayrl.engine.openai_api``). ``n`` samples are seeded ``seed, seed + 1, ...`` as
relayrl's vLLM client expects of a group. The route is behind the server's API key like
every route but ``GET /health`` (``relayrl.engine.server``).

Imports: fastapi, pydantic, the engine's plain types, relayrl.engine (chat, openai_api).
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from relayrl.engine.chat import Job, error_response, generate_jobs, json_body
from relayrl.engine.openai_api import OpenAIError, parse_body
from relayrl.engine.types import MAX_TOP_LOGPROBS, GenerationResult, SamplingParams

PATH = "/inference/v1/generate"

# fields of vLLM's SamplingParams the built-in engine does not implement: their neutral value
NEUTRAL_SAMPLING: dict[str, Any] = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_tokens": 0,
    "min_p": 0.0,
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is a 400 naming it


class TitoSampling(_Strict):
    """vLLM's sampling parameters (``max_tokens`` defaults to 16 as there)."""

    n: int = Field(1, ge=1, le=64)
    max_tokens: int = Field(16, gt=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # None: no logprobs; 0: the sampled token's; k: and the k most likely
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # about text the answer does not carry (token ids only): accepted as they are
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    min_p: float = 0.0

    def params(self, index: int) -> SamplingParams:
        """The engine's parameters of sample ``index`` (seed + index: distinct samples)."""
        for name, neutral in NEUTRAL_SAMPLING.items():
            if getattr(self, name) != neutral:
                raise OpenAIError(
                    f"sampling_params.{name}: not supported by relayrl's built-in engine "
                    f"(only {neutral} is accepted)",
                    f"sampling_params.{name}",
                    code="unsupported_field",
                )
        return SamplingParams(
            max_new_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            seed=None if self.seed is None else self.seed + index,
            ignore_eos=self.ignore_eos,
        )


class TitoIn(_Strict):
    token_ids: list[int] = Field(min_length=1)
    sampling_params: TitoSampling = Field(default_factory=TitoSampling)
    model: str | None = None  # the one served model, whatever it is called
    request_id: str | None = None
    stream: Literal[False] = False
    cache_salt: str | None = None  # a prefix-cache namespace: this engine shares no cache
    priority: Literal[0] | None = None  # one FIFO queue: only the default priority


def _checked_params(engine, body: TitoIn) -> list[SamplingParams]:
    """The parameters of each of the ``n`` samples, validated by the engine."""
    jobs = [body.sampling_params.params(i) for i in range(body.sampling_params.n)]
    for params in jobs:
        try:
            engine.validate(body.token_ids, params)
        except ValueError as exc:
            message = str(exc).replace("max_new_tokens", "max_tokens")
            message = message.replace("input_ids", "token_ids")
            raise OpenAIError(message, "token_ids" if "token_ids" in message else None) from None
    return jobs


def version_spans(versions: list[int]) -> list[dict[str, Any]]:
    """Per-token weight versions as spans ``{"start", "end", "version"}`` of equal ones."""
    spans: list[dict[str, Any]] = []
    for i, version in enumerate(versions):
        if spans and spans[-1]["version"] == str(version):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"start": i, "end": i + 1, "version": str(version)})
    return spans


def _logprobs(result: GenerationResult, top: int | None) -> dict[str, Any] | None:
    if top is None:
        return None
    content = []
    for i, (token, logprob) in enumerate(
        zip(result.output_ids, result.output_logprobs, strict=True)
    ):
        alternatives = result.output_top_logprobs[i] if top else []
        content.append(
            {
                "token": f"token_id:{token}",
                "logprob": logprob,
                "top_logprobs": [
                    {"token": f"token_id:{t}", "logprob": lp} for t, lp in alternatives
                ],
            }
        )
    return {"content": content}


def tito_answer(body: TitoIn, results: list[GenerationResult]) -> dict[str, Any]:
    top = body.sampling_params.logprobs
    choices = [
        {
            "index": i,
            "token_ids": result.output_ids,
            "logprobs": _logprobs(result, top),
            "finish_reason": result.finish_reason,
            "weight_versions": version_spans(result.output_versions),
        }
        for i, result in enumerate(results)
    ]
    completion = sum(len(r.output_ids) for r in results)
    return {
        "request_id": body.request_id or f"gen-{uuid.uuid4().hex}",
        "choices": choices,
        "usage": {
            "prompt_tokens": len(body.token_ids),
            "completion_tokens": completion,
            "total_tokens": len(body.token_ids) + completion,
        },
    }


def add_tito_route(app: FastAPI, engine) -> None:
    """Serve ``POST /inference/v1/generate`` from ``engine``."""

    @app.post(PATH)
    async def generate(request: Request):
        try:
            body = parse_body(TitoIn, await json_body(request))
            sampled = _checked_params(engine, body)
        except OpenAIError as exc:
            return error_response(exc)
        top = body.sampling_params.logprobs or 0
        jobs = [Job(i, body.token_ids, params, top) for i, params in enumerate(sampled)]
        results = await generate_jobs(request, engine, jobs)
        if isinstance(results, JSONResponse):
            return results
        return JSONResponse(tito_answer(body, results))
