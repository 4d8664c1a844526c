"""Async client of one or more rollout servers (ours or SGLang's native API).

Owns: connection pooling (one ``httpx.AsyncClient``), timeouts, retries with exponential
backoff on connection errors (never on 4xx), round-robin over servers with stickiness (the
same ``key`` always goes to the same server), broadcasting of pause / continue / weight
updates to every server, *resubmission after abort*, and batched generation of a whole group
in one HTTP exchange (:meth:`RolloutClient.generate_many`).

Two connection pools: generation requests share one (``max_connections``), control requests
(pause, resume, weight loads, health, info) have their own. A generation request sent to a
paused server holds its connection until the server resumes; with one shared pool, enough of
them (an asynchronous vLLM run keeps 2·B·n = 256 in flight, one per sample) left the resume,
or the load before it, waiting for a connection that only the resume would free: a
publication hung with the server paused and no error (issue 35).

Transport: plain ``http://`` servers go through :class:`relayrl.engine.http.FastHTTP` (O(1)
Python work per request; httpx's pool is O(connections²) per request, which with hundreds of
requests in flight starved the trainer of the GIL); other schemes through httpx.

Resubmission: when a result comes back with finish_reason "abort" (a weight update paused the
servers), :meth:`RolloutClient.generate` waits until generation is resumed (when this client
issued the pause, until its ``continue_generation``; otherwise the server itself queues the
request until it is resumed) and resubmits ``prompt + partial output`` with the remaining
token budget. Ids, logprobs and versions are concatenated, so earlier tokens keep their
logprobs and versions. The continuation's seed is ``continuation_seed(seed, n)`` with ``n``
the number of tokens already generated: a run is reproducible given the same interruption
points. After ``max_resubmits`` resubmissions a request that is still aborted comes back
with finish_reason "abort" and its partial output; the rollout controller rejects its group
(``rejected_aborted``) rather than train an incomplete sample.

Failover: with a ``recover`` callback (``async (url) -> url``, see
``relayrl.launch.supervisor``), a request whose server cannot be reached (connection refused or
reset after the retries, i.e. a :class:`RolloutServerError` without an HTTP status) awaits
``recover(url)`` — which restarts the server and returns its new URL, or raises when it gives
up — and is resubmitted there as ``prompt + the tokens received so far`` with the same seed
rule, at most ``max_failovers`` times per request. :meth:`replace_url` moves the server list
and sticky routes to the new URL.

Keys (docs/security.md): every request to a server carries ``Authorization: Bearer`` with
that server's key (:meth:`RolloutClient.key_for`): its own in ``server_keys`` (each server a
run launched holds a key of its own, a new one after a restart, which :meth:`replace_url`
:meth:`RolloutClient.set_key` gives the client), else ``api_key`` (the one key the user gave for the servers they
started). ``transfer_secret`` is the weight-transfer groups' rendezvous secret, which the
broadcast transport sends to the servers it asks to join a group.
"""

from __future__ import annotations

import asyncio
import itertools
import json as jsonlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from relayrl.engine.http import ConnectError, FastHTTP, header_lines
from relayrl.engine.types import SamplingParams
from relayrl.runkey import transfer_secret as derive_transfer_secret

RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError)
# the same failures on the asyncio transport (engine/http.py) used for plain http://
FAST_RETRYABLE = (ConnectError, ConnectionError, asyncio.IncompleteReadError)
MAX_STICKY_KEYS = 100_000
CONTROL_CONNECTIONS = 32  # the control pool's size (pause, resume, loads, health, info)
Recover = Callable[[str], Awaitable[str]]


class RolloutServerError(RuntimeError):
    """A server answered with an error or could not be reached; names the server URL."""

    def __init__(self, url: str, message: str, status: int | None = None) -> None:
        super().__init__(f"rollout server {url}: {message}")
        self.url = url
        self.status = status

    @property
    def unreachable(self) -> bool:
        """No HTTP answer at all (refused, reset, timed out): the server may be down."""
        return self.status is None


@dataclass
class Generation:
    """A finished (possibly resubmitted) request as seen by the client."""

    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: str
    prompt_tokens: int
    server: str
    resubmissions: int = 0
    failovers: int = 0
    text: str | None = None
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ServingInfo:
    """What a caller that only generates needs of one server: its context length (prompt +
    output tokens per request) and the weight version it is serving now."""

    max_seq_len: int
    weight_version: int


@dataclass(frozen=True)
class WeightsReport:
    """What a server says it serves after a publication: the version its new tokens carry
    and the checksum of the weights it loaded (``weights_checksum``; None: not reported)."""

    version: int
    checksum: str | None


def continuation_seed(seed: int | None, tokens_done: int) -> int | None:
    """Seed of a resubmitted request: a fixed function of the original seed and progress."""
    if seed is None:
        return None
    return (seed * 1_000_003 + tokens_done * 7_919 + 1) % (2**63 - 1)


def parse_generation(url: str, data: dict[str, Any]) -> Generation:
    """Turn a ``/generate`` JSON answer (ours or SGLang's) into a :class:`Generation`."""
    meta = data.get("meta_info", {})
    reason = meta.get("finish_reason")
    reason = reason.get("type") if isinstance(reason, dict) else (reason or "stop")
    ids = list(data.get("output_ids", []))
    logprobs = [float(x[0]) for x in meta.get("output_token_logprobs") or []]
    versions = meta.get("output_token_versions")
    if versions is None:  # e.g. SGLang: one version for the whole answer
        versions = [int(meta.get("weight_version") or 0)] * len(ids)
    return Generation(
        output_ids=ids,
        output_logprobs=logprobs,
        output_versions=[int(v) for v in versions],
        finish_reason=reason,
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        server=url,
        text=data.get("text"),
        meta_info=meta,
    )


def _params_dict(sampling_params: SamplingParams | dict[str, Any]) -> dict[str, Any]:
    """A mutable dict copy of sampling parameters given as a dataclass or a dict."""
    if isinstance(sampling_params, SamplingParams):
        return asdict(sampling_params)
    return dict(sampling_params)


def _wire_params(sampling_params: SamplingParams | dict[str, Any]) -> dict[str, Any]:
    """Sampling parameters as sent: unset (None) and empty-list fields left out."""
    params = _params_dict(sampling_params)
    return {k: v for k, v in params.items() if v is not None and v != []}


class RolloutClient:
    """Async client over ``urls``; use ``async with`` or call :meth:`close`."""

    def __init__(
        self,
        urls: str | list[str],
        api_key: str | None = None,
        timeout: float = 600.0,
        connect_timeout: float = 5.0,
        max_retries: int = 3,
        backoff: float = 0.2,
        max_connections: int = 256,
        max_resubmits: int = 32,
        recover: Recover | None = None,
        max_failovers: int = 8,
        server_keys: Mapping[str, str] | None = None,
        transfer_secret: str | None = None,
    ) -> None:
        self.urls = [u.rstrip("/") for u in ([urls] if isinstance(urls, str) else urls)]
        if not self.urls:
            raise ValueError("RolloutClient needs at least one server URL")
        # the key of a server with none of its own in server_keys (see the module docstring)
        self.api_key = api_key
        self._keys: dict[str, str | None] = {}  # URL -> the key its requests carry
        self._auth: dict[str, tuple[str, dict[str, str]]] = {}  # URL -> its header, 2 forms
        own = {url.rstrip("/"): key for url, key in (server_keys or {}).items()}
        for url in self.urls:
            self.set_key(url, own.get(url, api_key))
        if transfer_secret is None and api_key:
            transfer_secret = derive_transfer_secret(api_key)
        self.transfer_secret = transfer_secret
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            limits=httpx.Limits(max_connections=max_connections),
        )
        self._fast = FastHTTP({}, timeout, connect_timeout, max_connections)
        # control requests never wait for a connection behind generation (module docstring)
        self._http_control = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            limits=httpx.Limits(max_connections=CONTROL_CONNECTIONS),
        )
        self._fast_control = FastHTTP({}, timeout, connect_timeout, CONTROL_CONNECTIONS)
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_resubmits = max_resubmits
        self.recover = recover
        self.max_failovers = max_failovers
        self._rr = itertools.count()
        self._sticky: OrderedDict[str, str] = OrderedDict()
        self._resumed = asyncio.Event()
        self._resumed.set()

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._fast.aclose()
        await self._fast_control.aclose()
        await self._http.aclose()
        await self._http_control.aclose()

    # ------------------------------------------------------------------ routing
    def server_for(self, key: str | None = None) -> str:
        """Round-robin; a ``key`` seen before goes to the same server again."""
        if key is None:
            return self.urls[next(self._rr) % len(self.urls)]
        url = self._sticky.get(key)
        if url is None:
            url = self.urls[next(self._rr) % len(self.urls)]
            self._sticky[key] = url
            if len(self._sticky) > MAX_STICKY_KEYS:
                self._sticky.popitem(last=False)
        else:
            self._sticky.move_to_end(key)
        return url

    def replace_url(self, old: str, new: str) -> None:
        """Server ``old`` now lives at ``new`` (restarted): reroute everything to it. ``new``
        keeps the key :meth:`set_key` gave it (else ``api_key``); ``old`` is sent none."""
        new = new.rstrip("/")
        self.urls = [new if u == old else u for u in self.urls]
        for sticky, url in self._sticky.items():
            if url == old:
                self._sticky[sticky] = new
        if new not in self._keys:
            self.set_key(new, self.api_key)
        if old != new:
            self._keys.pop(old, None)
            self._auth.pop(old, None)

    def key_for(self, url: str) -> str | None:
        """The key requests to ``url`` carry (None: no ``Authorization`` header)."""
        return self._keys.get(url.rstrip("/"))

    def set_key(self, url: str, key: str | None) -> None:
        """Requests to ``url`` carry ``key`` from now on (a restarted server's own key)."""
        url = url.rstrip("/")
        self._keys[url] = key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._auth[url] = (header_lines(headers), headers)

    async def request(self, method: str, url: str, path: str, json: Any = None) -> Any:
        """One control call to the server at ``url`` (``GET``/``POST`` ``path`` with a JSON
        body), retried on connection errors; its decoded JSON answer. A server's error
        answer, a timeout or an unreachable server raise :class:`RolloutServerError`. For
        endpoints this class has no method for (a backend's own checks)."""
        return await self._request(method, url, path, json)

    async def _request(
        self, method: str, url: str, path: str, json: Any = None, generation: bool = False
    ) -> Any:
        """One HTTP call with retries on connection errors; raises RolloutServerError.
        ``generation``: a generate call (the generation pool), else a control call (the
        control pool; see the module docstring)."""
        fast = FastHTTP.supports(url)
        lines, headers = self._auth.get(url, ("", {}))
        if fast:
            http = self._fast if generation else self._fast_control
            send: Callable[..., Awaitable[tuple[int, bytes]]] = http.request
            auth: Any = lines
        else:
            send = self._send_httpx if generation else self._send_httpx_control
            auth = headers
        retryable = FAST_RETRYABLE if fast else RETRYABLE
        timeouts = asyncio.TimeoutError if fast else httpx.TimeoutException
        last: Exception | None = None
        for attempt in range(self.max_retries + 1):
            try:
                status, body = await send(method, url, path, json, auth)
            except retryable as exc:
                last = exc
                if attempt < self.max_retries:
                    await asyncio.sleep(self.backoff * 2**attempt)
                continue
            except timeouts as exc:
                raise RolloutServerError(url, f"{path} timed out: {exc!r}") from exc
            if status >= 400:
                text = body.decode("utf-8", "replace")
                raise RolloutServerError(url, f"{path} -> HTTP {status}: {text}", status)
            return jsonlib.loads(body) if body else None
        raise RolloutServerError(
            url, f"unreachable after {self.max_retries + 1} attempts ({last!r})"
        ) from last

    async def _send_httpx(
        self, method: str, url: str, path: str, json: Any, headers: dict[str, str]
    ) -> tuple[int, bytes]:
        response = await self._http.request(method, url + path, json=json, headers=headers)
        return response.status_code, response.content

    async def _send_httpx_control(
        self, method: str, url: str, path: str, json: Any, headers: dict[str, str]
    ) -> tuple[int, bytes]:
        response = await self._http_control.request(method, url + path, json=json, headers=headers)
        return response.status_code, response.content

    async def _broadcast(
        self, path: str, json: Any = None, urls: list[str] | None = None
    ) -> list[Any]:
        targets = self.urls if urls is None else urls
        return list(await asyncio.gather(*(self._request("POST", u, path, json) for u in targets)))

    # ------------------------------------------------------------------ control
    async def health(self) -> list[Any]:
        return list(await asyncio.gather(*(self._request("GET", u, "/health") for u in self.urls)))

    async def model_info(self) -> list[Any]:
        return list(
            await asyncio.gather(*(self._request("GET", u, "/get_model_info") for u in self.urls))
        )

    async def serving_info(self) -> list[ServingInfo]:
        """Each server's context length and current weight version (``/get_model_info``),
        in ``urls`` order."""
        infos = await self.model_info()
        return [
            ServingInfo(int(i["max_context_length"]), int(i.get("weight_version") or 0))
            for i in infos
        ]

    async def server_info(self) -> list[dict[str, Any]]:
        """Each server's engine counters (``/get_server_info``), in ``urls`` order."""
        return list(
            await asyncio.gather(*(self._request("GET", u, "/get_server_info") for u in self.urls))
        )

    async def pause(self, mode: str = "abort", urls: list[str] | None = None) -> list[Any]:
        """Pause every server (or ``urls``); requests aborted by it are resubmitted after
        ``continue``."""
        self._resumed.clear()
        return await self._broadcast("/pause_generation", {"mode": mode}, urls)

    async def continue_generation(self, urls: list[str] | None = None) -> list[Any]:
        try:
            return await self._broadcast("/continue_generation", urls=urls)
        finally:
            self._resumed.set()

    async def weights_report(self, url: str) -> WeightsReport:
        """What the server at ``url`` serves: its weight version and the checksum of its
        weights (``/weights_checksum``, computed over the model's own parameters)."""
        data = await self._request("GET", url, "/weights_checksum")
        return WeightsReport(int(data.get("weight_version") or 0), data.get("checksum"))

    async def update_weights(
        self,
        model_path: str,
        version: int | None = None,
        urls: list[str] | None = None,
        keep_kv: bool = False,
    ) -> list[Any]:
        """Load ``model_path`` on every server (or on ``urls``), tagging new tokens with
        ``version``; ``keep_kv``: running requests keep their KV (relayrl servers only)."""
        body: dict[str, Any] = {"model_path": str(model_path), "weight_version": version}
        if keep_kv:
            body["keep_kv"] = True
        return await self._broadcast("/update_weights_from_disk", body, urls)

    async def init_weights_update_group(self, url: str, body: dict[str, Any]) -> Any:
        """Ask the server at ``url`` to join a weight-transfer group (the broadcast transport:
        ``relayrl.sync.transports.broadcast``); returns when it has joined."""
        return await self._request("POST", url, "/init_weights_update_group", body)

    async def update_weights_from_distributed(self, url: str, body: dict[str, Any]) -> Any:
        """Ask the server at ``url`` to receive and load a broadcast publication; returns
        when it has loaded it (rank 0 must broadcast meanwhile)."""
        return await self._request("POST", url, "/update_weights_from_distributed", body)

    async def weights_checksum(self) -> list[dict[str, Any]]:
        """Each server's ``/weights_checksum`` (relayrl servers), in ``urls`` order."""
        return list(
            await asyncio.gather(*(self._request("GET", u, "/weights_checksum") for u in self.urls))
        )

    # ------------------------------------------------------------------ generation
    async def generate_once(
        self,
        input_ids: list[int],
        sampling_params: SamplingParams | dict[str, Any],
        key: str | None = None,
        url: str | None = None,
    ) -> Generation:
        """One generate call (:attr:`GENERATE_PATH`), no resubmission."""
        url = url or self.server_for(key)
        body = self.generate_body(input_ids, sampling_params)
        return self.parse_generation(url, await self.post_generation(url, body))

    async def post_generation(self, url: str, body: dict[str, Any]) -> Any:
        """POST one generation ``body`` (one request, or a batch or group of them) to
        :attr:`GENERATE_PATH` on ``url``; its decoded answer. The one place a backend adds
        what every generation needs (the vLLM client: its LoRA adapter)."""
        return await self._request("POST", url, self.GENERATE_PATH, body, generation=True)

    # the wire protocol of one generation (SGLang's native /generate; see VLLMClient), and
    # whether the server takes a list of prompts in one call (generate_many)
    GENERATE_PATH = "/generate"
    BATCHED_GENERATE = True

    def generate_body(
        self, input_ids: list[int], sampling_params: SamplingParams | dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "input_ids": list(input_ids),
            "sampling_params": _wire_params(sampling_params),
            "return_logprob": True,
        }

    def parse_generation(self, url: str, data: dict[str, Any]) -> Generation:
        return parse_generation(url, data)

    async def generate_many(
        self,
        input_ids: list[list[int]],
        sampling_params: list[SamplingParams | dict[str, Any]],
        key: str | None = None,
    ) -> list[Generation]:
        """Generate every prompt to completion in one batched ``/generate`` call (SGLang's
        list form) to one server: one HTTP exchange for a whole group instead of one per
        sample. Answers that come back aborted are resubmitted one by one; if the server
        cannot be reached, every prompt goes through :meth:`generate` (its failover)."""
        if len(input_ids) != len(sampling_params):
            raise ValueError(f"{len(input_ids)} prompts but {len(sampling_params)} params")
        if not self.BATCHED_GENERATE:  # one request per prompt, concurrently, same server
            pairs = zip(input_ids, sampling_params, strict=True)
            return list(await asyncio.gather(*(self.generate(i, p, key) for i, p in pairs)))
        url = self.server_for(key)
        body = {
            "input_ids": [list(ids) for ids in input_ids],
            "sampling_params": [_wire_params(p) for p in sampling_params],
            "return_logprob": True,
        }
        try:
            answers = await self.post_generation(url, body)
        except RolloutServerError as exc:
            if not exc.unreachable or self.recover is None:
                raise
            return list(
                await asyncio.gather(
                    *(
                        self.generate(i, p, key)
                        for i, p in zip(input_ids, sampling_params, strict=True)
                    )
                )
            )
        firsts = [parse_generation(url, answer) for answer in answers]
        return list(
            await asyncio.gather(
                *(
                    self._complete(ids, _params_dict(p), url, first)
                    for ids, p, first in zip(input_ids, sampling_params, firsts, strict=True)
                )
            )
        )

    async def input_logprobs(
        self,
        prompt_ids: list[int],
        completions: list[list[int]],
        temperature: float = 1.0,
        key: str | None = None,
    ) -> list[list[float]]:
        """Each completion's per-token logprobs given the prompt and its earlier tokens, as
        the server's model scores them (a teacher): one batched ``/generate`` call for the
        whole group with SGLang's ``logprob_start_len = len(prompt)`` and
        ``max_new_tokens = 0``; ``len(completion)`` values each."""
        url = self.server_for(key)
        body = {
            "input_ids": [list(prompt_ids) + list(c) for c in completions],
            "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
            "return_logprob": True,
            "logprob_start_len": len(prompt_ids),
        }
        answers = await self._request("POST", url, self.GENERATE_PATH, body)
        out = []
        for completion, answer in zip(completions, answers, strict=True):
            logprobs = [float(x[0]) for x in answer["meta_info"]["input_token_logprobs"]]
            if len(logprobs) != len(completion):
                raise RolloutServerError(
                    url, f"{len(logprobs)} input logprobs for a completion of {len(completion)}"
                )
            out.append(logprobs)
        return out

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: SamplingParams | dict[str, Any],
        key: str | None = None,
    ) -> Generation:
        """Generate to completion, resubmitting after aborts (see the module docstring)."""
        return await self._complete(
            input_ids, _params_dict(sampling_params), self.server_for(key), None
        )

    async def _complete(
        self,
        input_ids: list[int],
        params: dict[str, Any],
        url: str,
        first: Generation | None,
    ) -> Generation:
        """Finish one request on ``url`` from its ``first`` answer (None: not sent yet):
        resubmit after aborts, fail over when the server is unreachable."""
        budget = int(params.get("max_new_tokens", 128))
        seed = params.get("seed")
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        resubmits = failovers = 0
        while True:
            part = dict(params, max_new_tokens=budget - len(ids))
            part["seed"] = continuation_seed(seed, len(ids)) if ids else seed
            try:
                if first is None:
                    out = await self.generate_once(list(input_ids) + ids, part, url=url)
                else:
                    out, first = first, None
            except RolloutServerError as exc:
                if not exc.unreachable or self.recover is None:
                    raise
                if failovers >= self.max_failovers:
                    raise RolloutServerError(
                        url, f"still unreachable after {failovers} failovers ({exc})"
                    ) from exc
                failovers += 1
                url = await self.recover(url)
                continue
            ids += out.output_ids
            logprobs += out.output_logprobs
            versions += out.output_versions
            done = out.finish_reason != "abort" or len(ids) >= budget
            if done or resubmits >= self.max_resubmits:
                reason = (
                    "length"
                    if out.finish_reason == "abort" and len(ids) >= budget
                    else out.finish_reason
                )
                return Generation(
                    output_ids=ids,
                    output_logprobs=logprobs,
                    output_versions=versions,
                    finish_reason=reason,
                    prompt_tokens=len(input_ids),
                    server=url,
                    resubmissions=resubmits,
                    failovers=failovers,
                    # the server's text covers the whole output only if it came in one part
                    text=out.text if resubmits == failovers == 0 else None,
                    meta_info=out.meta_info,
                )
            resubmits += 1
            await self._resumed.wait()
