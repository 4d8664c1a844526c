"""The rollout server: an SGLang-style HTTP API (FastAPI + uvicorn) over one :class:`Engine`.

Endpoints: ``POST /generate``, ``POST /pause_generation``, ``POST /continue_generation``,
``POST /update_weights_from_disk``, ``GET /health``, ``GET /get_model_info``,
``GET /get_server_info``, ``GET /weights_checksum``, the broadcast weight transport's
``POST /init_weights_update_group`` and ``POST /update_weights_from_distributed``
(``relayrl.engine.transfer``; docs/cluster.md), OpenAI-compatible ``/v1`` endpoints (models,
chat and text completions, streamed or not) with token ids, logprobs and versions
(``relayrl.engine.chat``), and vLLM's token-in, token-out ``POST /inference/v1/generate``
(``relayrl.engine.tito``). Request and response shapes follow
SGLang's native API (see docs/engine.md) plus ``meta_info.output_token_versions``. Bad input gets a 4xx answer whose
``error`` names the field (one bad request of a batch or of an engine step fails alone); a
client that disconnects mid-request has its request aborted; bodies over 64 MiB and clients
slower than the read deadlines are cut off (``relayrl.engine.limits``).

Security (docs/security.md): the server binds 127.0.0.1 by default; any other host requires an
API key. With a key, every request but ``GET /health`` must carry ``Authorization: Bearer
<key>`` (401 otherwise): the weight, pause and transfer-group endpoints, and generation too
(it costs compute and reads the policy). A run's launcher always starts its servers with a
fresh key (``relayrl.launch.backends``), also on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import itertools
import socket
import threading
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from relayrl.engine.adapter import adapter_from_tensors
from relayrl.engine.chat import add_chat_route
from relayrl.engine.engine import Engine
from relayrl.engine.limits import BodyLimitMiddleware, DeadlineH11Protocol, await_or_disconnect
from relayrl.engine.tito import add_tito_route
from relayrl.engine.transfer import BACKENDS, TransferGroup, dtype_from_name, join_in_own_thread
from relayrl.engine.types import GenerationResult, PauseMode, SamplingParams
from relayrl.errors import RelayError
from relayrl.runkey import CHALLENGE_HEADER, MAX_CHALLENGE, PROOF_HEADER, health_proof


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingParamsIn(_Strict):
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    sampling_seed: int | None = None  # SGLang's name for the seed
    ignore_eos: bool = False

    def to_params(self) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        seed = self.seed if self.seed is not None else self.sampling_seed
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            seed=seed,
            ignore_eos=self.ignore_eos,
        )


class GenerateIn(_Strict):
    """One prompt, or a batch (SGLang's form): a list of prompts with one sampling-params
    object for all or one per prompt, answered with a list in the same order."""

    input_ids: list[int] | list[list[int]]
    sampling_params: SamplingParamsIn | list[SamplingParamsIn] = Field(
        default_factory=SamplingParamsIn
    )
    return_logprob: bool = False
    # SGLang's: ≥ 0 asks for the logprobs of the input tokens from this position on
    # (scoring only here: with max_new_tokens = 0; relayrl.engine.server._score_inputs)
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    stream: Literal[False] = False

    @property
    def batched(self) -> bool:
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    def requests(self) -> list[tuple[list[int], SamplingParams, str]]:
        """(prompt, params, rid) per prompt; ``ValueError`` names a field whose length does
        not match the number of prompts."""
        prompts = self.input_ids if self.batched else [self.input_ids]
        n = len(prompts)
        params = self.sampling_params
        params = params if isinstance(params, list) else [params] * n
        rids = self.rid if isinstance(self.rid, list) else [self.rid] * n
        for name, values in (("sampling_params", params), ("rid", rids)):
            if len(values) != n:
                raise ValueError(f"{name}: {len(values)} entries for {n} prompts in input_ids")
        return [
            (prompt, p.to_params(), rid or uuid.uuid4().hex)
            for prompt, p, rid in zip(prompts, params, rids, strict=True)
        ]


class PauseIn(_Strict):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class UpdateWeightsIn(_Strict):
    model_path: str
    weight_version: int | None = None
    load_format: Literal["auto", "safetensors"] | None = None
    abort_all_requests: bool = False
    # relayrl extension: running requests keep their KV across the update (in-flight update)
    keep_kv: bool = False


MAX_GROUP_SIZE = 1 << 16
MAX_GROUP_TIMEOUT_S = 86400.0


class InitGroupIn(_Strict):
    """Join the weight-transfer group (SGLang's ``/init_weights_update_group``): this server
    is rank ``rank_offset`` of ``world_size``, rank 0 (the trainer) hosts the rendezvous."""

    master_address: str = Field(min_length=1, max_length=255)
    master_port: int = Field(gt=0, lt=65536)
    rank_offset: int = Field(ge=1, le=MAX_GROUP_SIZE)
    world_size: int = Field(ge=2, le=MAX_GROUP_SIZE)
    group_name: str = Field(min_length=1, max_length=255)
    backend: str = "gloo"
    # relayrl extension: the deadline of the join and of every broadcast in the group
    # (bounded: 1e300 overflowed the timedelta after the current group was torn down)
    timeout_s: float = Field(60.0, gt=0, le=MAX_GROUP_TIMEOUT_S, allow_inf_nan=False)
    # relayrl extension: the secret of the group's rendezvous keys (``store_prefix``), the
    # trainer's, derived from the run key; never this server's own key (docs/security.md)
    secret: str | None = Field(None, max_length=256)


class UpdateDistributedIn(_Strict):
    """Receive one publication by broadcast from rank 0 (SGLang's
    ``/update_weights_from_distributed``): one tensor per name, in this order."""

    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str
    version: int | None = None
    weight_version: int | None = None  # SGLang's name of ``version``
    flush_cache: bool = True  # accepted as SGLang's; the KV is handled as keep_kv says
    abort_all_requests: bool = False
    keep_kv: bool = False
    # relayrl extension: a LoRA adapter publication (docs/lora.md): the names are
    # '<module>.lora_A' / '<module>.lora_B', merged into the server's copy of the base with
    # this scale (alpha / r)
    lora_scale: float | None = Field(None, allow_inf_nan=False)

    def specs(self) -> list[tuple[str, Any, list[int]]]:
        """(name, dtype, shape) per tensor; ``ValueError`` names the bad field."""
        n = len(self.names)
        for field_name, values in (("dtypes", self.dtypes), ("shapes", self.shapes)):
            if len(values) != n:
                raise ValueError(f"{field_name}: {len(values)} entries for {n} names")
        if len(set(self.names)) != n:
            raise ValueError("names: a tensor is named twice")
        dtypes = []
        for i, name in enumerate(self.dtypes):
            try:
                dtypes.append(dtype_from_name(name))
            except ValueError as exc:
                raise ValueError(f"dtypes[{i}]: {exc}") from None
        return list(zip(self.names, dtypes, self.shapes, strict=True))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None, open_control_plane: bool = False) -> None:
    """Refuse to expose the server beyond this machine without an API key, and an open
    control plane anywhere but on loopback."""
    if open_control_plane and not is_loopback(host):
        raise RelayError(
            f"--open-control-plane serves weight loads and pauses to anyone who can reach "
            f"it, so it is allowed on a loopback host only, not on {host!r}"
        )
    if not is_loopback(host) and not api_key:
        raise RelayError(
            f"refusing to serve on non-loopback host {host!r} without an API key; "
            "set RELAYRL_API_KEY or RELAYRL_API_KEY_FILE (or pass --api-key-file) or bind "
            "127.0.0.1"
        )


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": message, "success": False})


def _finish_reason(result: GenerationResult) -> dict[str, Any]:
    if result.finish_reason == "length":
        return {"type": "length", "length": len(result.output_ids)}
    if result.finish_reason == "stop":
        return {"type": "stop", "matched": result.matched_stop}
    return {"type": "abort", "message": "request aborted (pause, disconnect or shutdown)"}


def _response(engine: Engine, result: GenerationResult, req: GenerateIn) -> dict[str, Any]:
    tok = engine.tokenizer
    # special tokens (EOS) left out of the text, as SGLang's default skip_special_tokens
    text = tok.decode(result.output_ids, skip_special_tokens=True) if tok is not None else None
    versions = result.output_versions
    meta: dict[str, Any] = {
        "id": result.rid,
        "finish_reason": _finish_reason(result),
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": len(result.output_ids),
        "cached_tokens": 0,
        "weight_version": versions[-1] if versions else engine.weight_version,
        "output_token_versions": versions,
        "e2e_latency": result.latency,
    }
    if req.return_logprob:
        decode = (
            engine.tokenizer.decode if req.return_text_in_logprobs and engine.tokenizer else None
        )
        meta["output_token_logprobs"] = [
            [lp, tok, decode([tok]) if decode else None]
            for lp, tok in zip(result.output_logprobs, result.output_ids, strict=True)
        ]
    return {"text": text, "output_ids": result.output_ids, "meta_info": meta}


def _checked_requests(engine: Engine, body: GenerateIn) -> list[tuple[list[int], Any, str]]:
    """The body's requests, each validated; ``ValueError`` names the bad one of a batch."""
    requests = body.requests()
    for i, (prompt, params, _) in enumerate(requests):
        try:
            engine.validate(prompt, params)
        except ValueError as exc:
            if body.batched:
                raise ValueError(f"input_ids[{i}]: {exc}") from None
            raise
    return requests


async def _score_inputs(engine: Engine, body: GenerateIn) -> JSONResponse:
    """SGLang's input-token logprobs (``return_logprob``, ``logprob_start_len = k``,
    ``max_new_tokens = 0``): ``meta_info.input_token_logprobs`` lists ``[logprob, id, None]``
    for every input token from position k on, the logprob of token i given tokens < i under
    ``log_softmax(logits / T)`` (``None`` for position 0); nothing is generated. How a
    teacher server scores a student's tokens (on-policy distillation)."""
    start = body.logprob_start_len
    prompts = body.input_ids if body.batched else [body.input_ids]
    params = body.sampling_params
    params = params if isinstance(params, list) else [params] * len(prompts)
    if not body.return_logprob or any(p.max_new_tokens != 0 for p in params):
        return _error(
            400,
            "logprob_start_len >= 0 scores the input only: it needs "
            "return_logprob=true and sampling_params.max_new_tokens=0",
        )
    answers = []
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        if not start < len(ids):
            return _error(400, f"input_ids[{i}]: logprob_start_len {start} >= {len(ids)} tokens")
        try:
            logprobs = await engine.run_async(engine.score, ids, p.temperature)
        except ValueError as exc:
            return _error(400, f"input_ids[{i}]: {exc}")
        scored = [None, *logprobs][start:]
        meta = {
            "prompt_tokens": len(ids),
            "completion_tokens": 0,
            "input_token_logprobs": [
                [lp, t, None] for lp, t in zip(scored, ids[start:], strict=True)
            ],
        }
        answers.append({"text": "", "output_ids": [], "meta_info": meta})
    return JSONResponse(answers if body.batched else answers[0])


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            parts.append(f"body: malformed JSON ({detail})".replace(" ()", ""))
            continue
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)


OPEN_PATHS = frozenset({"/health"})  # answered without the key (GET only): liveness probes
# what replaces or stops the policy: closed on a server without a key (403) unless it was
# started with an open control plane (``relayrl serve --open-control-plane``, loopback only)
CONTROL_PATHS = frozenset(
    {
        "/update_weights_from_disk",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/pause_generation",
        "/continue_generation",
    }
)
CLOSED_CONTROL = (
    "this server has no API key, so its control plane (weight loads, pause, resume, "
    "transfer groups) is closed: start it with a key (--api-key-file FILE, $RELAYRL_API_KEY "
    "or $RELAYRL_API_KEY_FILE; docs/security.md) and send it as 'Authorization: Bearer "
    "<key>', or pass --open-control-plane (loopback only) to let every local user drive it"
)


def _proving(send, key: str, port: int, challenge: str):
    """``send`` with the answer to a ``GET /health`` challenge added to the response's
    headers (:func:`relayrl.runkey.health_proof`)."""
    proof = health_proof(key, port, challenge).encode()

    async def proving_send(message) -> None:
        if message["type"] == "http.response.start":
            headers = [*message.get("headers", []), (PROOF_HEADER.encode(), proof)]
            message = {**message, "headers": headers}
        await send(message)

    return proving_send


def _challenge(scope) -> str | None:
    """The ``GET /health`` challenge of a request (None: none, or too long to answer)."""
    raw = dict(scope.get("headers") or []).get(CHALLENGE_HEADER.encode())
    text = raw.decode("latin-1") if raw else None
    return text if text and len(text) <= MAX_CHALLENGE else None


class ApiKeyMiddleware:
    """Pure ASGI middleware: every HTTP request but ``GET /health`` needs
    ``Authorization: Bearer <key>``; a ``GET /health`` with a challenge gets the proof that
    this server holds the key (``x-relayrl-proof``), so a launcher can tell its own server
    from a process squatting its port without ever sending the key."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.api_key = api_key
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            if scope.get("method") in ("GET", "HEAD") and scope.get("path") in OPEN_PATHS:
                challenge = _challenge(scope)
                if challenge is not None:
                    port = (scope.get("server") or ("", 0))[1] or 0
                    send = _proving(send, self.api_key, port, challenge)
                await self.app(scope, receive, send)
                return
            header = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(header, self.expected):
                response = _error(401, "missing or wrong API key (Authorization: Bearer <key>)")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ClosedControlMiddleware:
    """Pure ASGI middleware of a server without a key: the :data:`CONTROL_PATHS` answer 403
    (:data:`CLOSED_CONTROL` says how to open them); generation and reading are served."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("path", "").rstrip("/") in CONTROL_PATHS:
            await _error(403, CLOSED_CONTROL)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_app(
    engine: Engine, api_key: str | None = None, open_control_plane: bool = True
) -> FastAPI:
    """The FastAPI application serving ``engine``; without ``api_key`` its control routes
    are open only with ``open_control_plane`` (in-process use: tests, embedding; ``relayrl
    serve`` closes them unless told otherwise, :class:`ClosedControlMiddleware`).

    Why over 80 lines: one short closure per endpoint over ``engine`` (FastAPI's route
    decorators on this app); split into functions they would each take the engine and the
    app and be registered the same way, with nothing gained in reading."""
    app = FastAPI(title="relayrl rollout server")
    app.state.engine = engine
    app.add_middleware(BodyLimitMiddleware)  # inside the key check: no body read before it
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    elif not open_control_plane:
        app.add_middleware(ClosedControlMiddleware)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_: Request, exc: RequestValidationError):
        return _error(400, _validation_message(exc))

    @app.get("/health")
    async def health():
        problem = engine.health_problem()
        if problem is not None:  # live but unable to serve: not ready (supervisors restart it)
            return JSONResponse(status_code=503, content={"status": "error", "error": problem})
        return {"status": "ok"}

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {
            "model_path": engine.model_path,
            "tokenizer_path": engine.model_path,
            "is_generation": True,
            "vocab_size": engine.vocab_size,
            "max_context_length": engine.max_seq_len,
            "max_running_requests": engine.num_slots,
            "weight_version": engine.weight_version,
        }

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return await engine.run_async(engine.stats)

    @app.post("/generate")
    async def generate(body: GenerateIn, request: Request):
        if body.logprob_start_len >= 0:
            return await _score_inputs(engine, body)
        try:
            requests = _checked_requests(engine, body)
        except ValueError as exc:
            return _error(400, str(exc))
        task = asyncio.gather(*(engine.generate(*request) for request in requests))
        if not await await_or_disconnect(request, task):
            return _error(499, "client disconnected")
        try:
            results = task.result()
        except ValueError as exc:
            return _error(400, str(exc))
        answers = [_response(engine, result, body) for result in results]
        # a ready-made JSONResponse skips FastAPI's recursive jsonable_encoder over the
        # per-token lists (a third of the server's HTTP time at 128 requests in flight)
        return JSONResponse(answers if body.batched else answers[0])

    @app.post("/pause_generation")
    async def pause(body: PauseIn | None = None):
        results = await engine.run_async(engine.pause, PauseMode((body or PauseIn()).mode))
        return {"success": True, "aborted": len(results)}

    @app.post("/continue_generation")
    async def resume():
        await engine.run_async(engine.continue_generation)
        return {"success": True}

    async def load(source: Any, version: int | None, keep_kv: bool, abort_all: bool) -> int:
        """Load ``source`` (a path or a state dict) as a publication: the same pause, retract
        and version bookkeeping whichever transport brought it."""
        if abort_all:
            await engine.run_async(engine.pause, PauseMode.ABORT)
        try:
            return await engine.run_async(engine.update_weights, source, version, keep_kv)
        finally:
            if abort_all:
                await engine.run_async(engine.continue_generation)

    @app.post("/update_weights_from_disk")
    async def update_weights(body: UpdateWeightsIn):
        start = time.perf_counter()
        try:
            version = await load(
                body.model_path, body.weight_version, body.keep_kv, body.abort_all_requests
            )
        except RelayError as exc:
            return _error(400, f"model_path: {exc}")
        return {
            "success": True,
            "message": f"loaded weights from {body.model_path} in {time.perf_counter() - start:.2f}s",
            "weight_version": version,
        }

    app.state.transfer = None  # the weight-transfer group joined, if any
    app.state.transfer_order = -1  # the arrival number of the join request that formed it
    join_order = itertools.count()
    transfer_lock = asyncio.Lock()  # one broadcast update at a time; groups swap between them

    @app.post("/init_weights_update_group")
    async def init_group(body: InitGroupIn):
        if body.backend not in BACKENDS:
            return _error(
                400,
                f"backend: {body.backend!r} is not available on the built-in engine; "
                f"expected one of {list(BACKENDS)}",
            )
        if body.rank_offset >= body.world_size:
            return _error(
                400, f"rank_offset: {body.rank_offset} is not below world_size {body.world_size}"
            )
        # joins are not serialized: one for a group its trainer already gave up (a server
        # resumed after SIGSTOP answers the stale request first) can wait in gloo for several
        # times its timeout, and the trainer's next group must not wait behind it
        order = next(join_order)
        try:
            group = await join_in_own_thread(
                body.master_address,
                body.master_port,
                body.rank_offset,
                body.world_size,
                body.group_name,
                body.timeout_s,
                body.secret,
            )
        except RelayError as exc:
            return _error(504, f"init_weights_update_group: {exc}")
        async with transfer_lock:  # never swapped under a broadcast being received
            if order < app.state.transfer_order:  # a later request's group is already in
                group.close()
                return _error(
                    409, f"group_name: {body.group_name!r} was superseded by a later join"
                )
            old, app.state.transfer = app.state.transfer, group
            app.state.transfer_order = order
        if old is not None:
            old.close()
        return {"success": True, "message": f"joined {body.group_name!r} as rank {group.rank}"}

    @app.post("/update_weights_from_distributed")
    async def update_from_distributed(body: UpdateDistributedIn):
        try:
            specs = body.specs()
            shapes = {name: shape for name, _, shape in specs}
            if body.lora_scale is None:
                engine.check_weight_shapes(shapes)
            else:
                engine.check_adapter_shapes(shapes)
        except (ValueError, RelayError) as exc:
            return _error(400, str(exc))
        start = time.perf_counter()
        async with transfer_lock:
            group: TransferGroup | None = app.state.transfer
            if group is None or group.name != body.group_name:
                joined = "no group" if group is None else f"group {group.name!r}"
                return _error(
                    409,
                    f"group_name: {body.group_name!r} is not the joined transfer group "
                    f"(this server has {joined}); POST /init_weights_update_group first",
                )
            try:
                state = await asyncio.to_thread(group.receive, specs)
            except (RuntimeError, RelayError) as exc:
                group.close()  # a broken group is never used again: the trainer re-forms it
                app.state.transfer = None
                return _error(
                    500,
                    f"update_weights_from_distributed: the broadcast in group "
                    f"{body.group_name!r} failed ({exc}); the group is left, "
                    "rejoin with /init_weights_update_group",
                )
        version = body.version if body.version is not None else body.weight_version
        source: Any = state
        if body.lora_scale is not None:
            source = adapter_from_tensors(state, body.lora_scale, "the broadcast adapter")
        try:
            version = await load(source, version, body.keep_kv, body.abort_all_requests)
        except RelayError as exc:
            return _error(400, f"names: {exc}")
        return {
            "success": True,
            "message": f"received and loaded {len(specs)} tensors in "
            f"{time.perf_counter() - start:.2f}s",
            "weight_version": version,
        }

    @app.get("/weights_checksum")
    async def checksum():
        return {
            "checksum": await engine.run_async(engine.weights_checksum),
            "weight_version": engine.weight_version,
        }

    add_chat_route(app, engine)  # OpenAI-compatible /v1/models, chat and text completions
    add_tito_route(app, engine)  # vLLM's token-in, token-out /inference/v1/generate
    return app


class ServerThread:
    """Run uvicorn for ``app`` in a background thread (tests, embedded use)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", lifespan="off", http=DeadlineH11Protocol
        )
        self.server = uvicorn.Server(config)
        self.host = host
        self._thread = threading.Thread(target=self.server.run, name="relayrl-server", daemon=True)

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the rollout server did not start")
            time.sleep(0.02)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)


def serve(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 30000,
    api_key: str | None = None,
    access_log: bool = False,
    open_control_plane: bool = False,
    sock: socket.socket | None = None,
):
    """Serve ``engine`` in the foreground until interrupted.

    ``access_log`` (off by default, as vLLM's ``--disable-log-requests``): one log line per
    HTTP request; an RL run makes hundreds per second. ``sock``: an already listening socket
    to serve on instead of binding ``host:port`` (the launcher's, inherited: no other
    process could take the port while this one was loading the model).
    """
    import uvicorn

    check_bind(host, api_key, open_control_plane)
    config = uvicorn.Config(
        create_app(engine, api_key, open_control_plane),
        host=host,
        port=port,
        log_level="info",
        access_log=access_log,
        http=DeadlineH11Protocol,  # header and body read deadlines (relayrl.engine.limits)
    )
    server = uvicorn.Server(config)
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=None if sock is None else [sock])
    if not server.started:
        raise RelayError(f"the rollout server could not start listening on {host}:{port}")
