"""The rollout client over vLLM's RL endpoints (vLLM 0.32 OpenAI server in dev mode).

Owns: :class:`VLLMClient`, the :class:`RolloutClient` of ``rollout.engine=vllm``. Routing,
retries, resubmission after aborts and failover are the base class's; this class speaks
vLLM's wire protocol instead of the SGLang-style one:

* generation: ``POST /inference/v1/generate`` (token ids in, token ids out; no
  re-tokenisation), ``logprobs=0`` so each sampled token's logprob comes back; the server runs
  with ``--logprobs-mode processed_logprobs``, i.e. ``log_softmax(logits / T)`` after the
  temperature (and top-k/top-p, which relayrl leaves off for exact RL), what the trainer
  recomputes. Each choice carries ``weight_versions`` spans ``[start, end)`` of output
  tokens per weight version; they become the per-token versions. vLLM's initial label
  ``"default"`` is version 0. ``detokenize`` is off: relayrl reads token ids only, and the
  server's per-step detokenisation took CPU from generation.
* a group: vLLM has no list form, but a request with ``n`` samples one prompt ``n`` times,
  sample ``j`` with seed ``seed + j`` (vLLM's parallel sampling). relayrl's request seeds
  within a group are consecutive (``relayrl.rollout.controller.request_seed``), so a group
  whose samples share the prompt and every parameter but a seed ``s0 + j`` is exactly one
  request with ``n`` and seed ``s0`` (:func:`group_request`): the same tokens, logprobs and
  versions as ``n`` requests, in one HTTP exchange. Any other group goes out as concurrent
  requests, one per sample, as does a group the server refuses for ``n`` above its
  ``max_num_seqs``. Samples of a group that come back aborted are resubmitted one by one.
* publication: ``POST /pause?mode=abort|keep``, ``POST /collective_rpc`` with
  ``relayrl_load_weights`` (relayrl's worker extension, ``relayrl_vllm_ext``: vLLM's
  ``reload_weights`` plus a rebuild of the CPU GEMM handles a tied LM head keeps),
  ``POST /update_weight_version``, ``POST /resume``. The version is set while paused, so every
  token sampled after the resume carries the new version and none before it does.
  ``abort``: running requests come back with ``finish_reason="abort"`` and their partial
  output and are resubmitted (prefilled again under the new weights); ``keep``
  (``train.publish_mode=inflight``): they stay in the engine with their KV and continue under
  the new weights, their spans recording where the version changed.
* the broadcast transport (``train.weight_transport=broadcast``, ``relayrl.sync.transports.broadcast``):
  :meth:`VLLMClient.init_weights_update_group` and
  :meth:`VLLMClient.update_weights_from_distributed` take the built-in server's endpoint
  bodies and make them ``/collective_rpc`` calls of the extension's ``relayrl_join_group``
  and ``relayrl_receive_weights`` (a gloo group over relayrl's wire module), the receive
  wrapped as a disk load is: pause, receive and load, set the version, resume. The extension
  reports a failure in its result (``success: false``), which becomes a
  :class:`RolloutServerError` naming the server.
* LoRA (``lora=True``: ``model.lora``, docs/lora.md "vLLM"): an adapter snapshot is served
  as vLLM's dynamic LoRA adapter, the base weights untouched: its PEFT directory
  (``relayrl.engine.adapter.peft_dir``) is loaded with ``POST /v1/load_lora_adapter``
  (``load_inplace``) under the one name :data:`ADAPTER_NAME`, and every generate request
  names that adapter (``model``), from the run's start: before its first publication a
  server serves a zero adapter (the worker extension's ``relayrl_base_adapter``: loaded at
  the run's start by the backend's check, before the first request to a server that lists
  no adapter, after a full-weight load, and when a server no longer knows the name, e.g.
  restarted at the same address). Before each load, ``relayrl_lora_setup`` stops vLLM from
  reloading the adapter on every step (see the extension). Requests never
  switch between the base model and an adapter, so an adapter publication is exactly a
  weight publication: the same pause, label and resume, and a request kept through it
  (``keep``) continues under the new adapter as it would under new weights. Each load is
  checked by ``/v1/models`` listing the adapter from the directory loaded.

Imports: relayrl.engine.adapter, relayrl.engine.client, relayrl.engine.types.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from relayrl.engine.adapter import is_adapter_snapshot, peft_dir
from relayrl.engine.client import (
    Generation,
    RolloutClient,
    RolloutServerError,
    ServingInfo,
    WeightsReport,
    _params_dict,
)
from relayrl.engine.types import SamplingParams

LOAD_METHOD = "relayrl_load_weights"
BASE_ADAPTER_METHOD = "relayrl_base_adapter"
LORA_SETUP_METHOD = "relayrl_lora_setup"
JOIN_METHOD = "relayrl_join_group"
RECEIVE_METHOD = "relayrl_receive_weights"
ADAPTER_NAME = "policy-lora"  # the served LoRA adapter's name (loaded in place each time)
# vLLM's pause modes for the built-in engine's: abort-and-resubmit, or keep running requests
PAUSE_MODES = {"abort": "abort", "retract": "abort", "in_place": "keep", "keep": "keep"}
MISSING_LOGPROB = -9999.0  # vLLM's sentinel for a token absent from its logprob map


def vllm_sampling_params(params: dict[str, Any]) -> dict[str, Any]:
    """relayrl's sampling parameters as vLLM's ``SamplingParams`` fields."""
    if params.get("stop"):
        raise ValueError("stop strings are not supported by the vLLM backend (token ids only)")
    out: dict[str, Any] = {
        "max_tokens": int(params.get("max_new_tokens", 128)),
        "temperature": float(params.get("temperature", 1.0)),
        "top_p": float(params.get("top_p", 1.0)),
        "top_k": int(params.get("top_k", -1)),
        "logprobs": 0,
        "ignore_eos": bool(params.get("ignore_eos", False)),
        "skip_special_tokens": False,
        "detokenize": False,  # token ids in and out: no text, no per-step detokenisation
    }
    if params.get("seed") is not None:
        out["seed"] = int(params["seed"])
    if params.get("stop_token_ids"):
        out["stop_token_ids"] = [int(t) for t in params["stop_token_ids"]]
    return out


def span_versions(spans: list[dict[str, Any]] | None, n: int, url: str) -> list[int]:
    """Per-token versions from vLLM's ``weight_versions`` spans over ``n`` output tokens."""
    if n == 0:
        return []
    if not spans:
        raise RolloutServerError(url, f"no weight_versions for {n} output tokens")
    versions: list[int] = []
    for span in spans:
        label = str(span["version"])
        if int(span["start"]) != len(versions):
            raise RolloutServerError(url, f"weight_versions spans not contiguous: {spans}")
        version = _int_version(label, url)
        versions += [version] * (int(span["end"]) - int(span["start"]))
    if len(versions) != n:
        raise RolloutServerError(url, f"weight_versions cover {len(versions)} of {n} tokens")
    return versions


def _int_version(label: str, url: str) -> int:
    """A vLLM weight-version label as relayrl's version (the initial ``"default"`` is 0)."""
    if label == "default":
        return 0
    try:
        return int(label)
    except ValueError:
        raise RolloutServerError(
            url, f"weight version {label!r} is not an integer (set by someone else?)"
        ) from None


def group_request(
    input_ids: list[list[int]], params: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """The one request with ``n`` that samples exactly this group (module docstring), or
    None when it is not one: prompts differ, parameters other than the seed differ, or the
    seeds are not ``s0, s0 + 1, ...`` (or all unset)."""
    first, seeds = params[0], [p.get("seed") for p in params]
    if any(ids != input_ids[0] for ids in input_ids[1:]):
        return None
    if any({**p, "seed": None} != {**first, "seed": None} for p in params[1:]):
        return None
    if seeds[0] is None:
        if any(s is not None for s in seeds):
            return None
    elif any(s is None or int(s) != int(seeds[0]) + j for j, s in enumerate(seeds)):
        return None
    sampling = vllm_sampling_params(first) | {"n": len(params)}
    return {"token_ids": [int(t) for t in input_ids[0]], "sampling_params": sampling}


def parse_vllm_generation(url: str, data: dict[str, Any]) -> Generation:
    """Turn a ``/inference/v1/generate`` answer of one sample into a :class:`Generation`."""
    return parse_vllm_choice(url, data["choices"][0], data)


def parse_vllm_group(url: str, data: dict[str, Any], n: int) -> list[Generation]:
    """The ``n`` samples of a group's answer (:func:`group_request`), in sample order
    (choice ``index`` ``j`` is the sample seeded ``s0 + j``)."""
    choices = sorted(data.get("choices") or [], key=lambda c: int(c.get("index", -1)))
    if [int(c.get("index", -1)) for c in choices] != list(range(n)):
        raise RolloutServerError(url, f"a group of {n} came back with {len(choices)} choices")
    return [parse_vllm_choice(url, choice, data) for choice in choices]


def parse_vllm_choice(url: str, choice: dict[str, Any], data: dict[str, Any]) -> Generation:
    """One choice of a ``/inference/v1/generate`` answer as a :class:`Generation`."""
    ids = [int(t) for t in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content") or []
    logprobs = [float(c["logprob"]) for c in content]
    if len(logprobs) != len(ids) or any(lp <= MISSING_LOGPROB for lp in logprobs):
        raise RolloutServerError(url, f"logprobs missing for some of {len(ids)} output tokens")
    usage = data.get("usage") or {}
    return Generation(
        output_ids=ids,
        output_logprobs=logprobs,
        output_versions=span_versions(choice.get("weight_versions"), len(ids), url),
        finish_reason=choice.get("finish_reason") or "stop",
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        server=url,
    )


def parse_serving_info(url: str, models: Any, weight_info: Any) -> ServingInfo:
    """``GET /v1/models`` (the served model's ``max_model_len``) and ``GET /weight_info``
    (``{"weight_version": label}``) as a :class:`ServingInfo`."""
    data = models.get("data") if isinstance(models, dict) else None
    length = data[0].get("max_model_len") if data and isinstance(data[0], dict) else None
    if not isinstance(length, int):
        raise RolloutServerError(url, f"/v1/models names no max_model_len: {models!r}")
    label = weight_info.get("weight_version") if isinstance(weight_info, dict) else None
    if label is None:
        raise RolloutServerError(url, f"/weight_info names no weight_version: {weight_info!r}")
    return ServingInfo(length, _int_version(str(label), url))


class VLLMClient(RolloutClient):
    """:class:`RolloutClient` over vLLM servers; see the module docstring."""

    def __init__(self, *args: Any, lora: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._paused_by_us = False
        self._loaded: dict[str, str | None] = {}  # URL -> checksum its last load reported
        self._refused_n = 1 << 30  # the smallest group a server refused as one request
        self.lora = lora  # requests name ADAPTER_NAME (module docstring)
        self._adapters: dict[str, str] = {}  # URL -> the PEFT directory it serves
        self._adapter_locks: dict[str, asyncio.Lock] = {}

    # ------------------------------------------------------------------ control
    async def server_info(self) -> list[dict[str, Any]]:
        """Each server's weight version (vLLM keeps no engine counters of ours)."""
        return list(
            await asyncio.gather(*(self._request("GET", u, "/weight_info") for u in self.urls))
        )

    async def serving_info(self) -> list[ServingInfo]:
        """Each server's ``max_model_len`` (``/v1/models``) and weight version
        (``/weight_info``: vLLM's label, ``"default"`` being version 0), in ``urls`` order."""
        return list(await asyncio.gather(*(self._serving_info(u) for u in self.urls)))

    async def _serving_info(self, url: str) -> ServingInfo:
        models = await self._request("GET", url, "/v1/models")
        return parse_serving_info(url, models, await self._request("GET", url, "/weight_info"))

    async def _pause(self, mode: str, urls: list[str] | None = None) -> list[Any]:
        vllm_mode = PAUSE_MODES.get(mode)
        if vllm_mode is None:
            raise ValueError(f"pause mode must be one of {sorted(PAUSE_MODES)}, got {mode!r}")
        return await self._broadcast(f"/pause?mode={vllm_mode}", urls=urls)

    async def pause(self, mode: str = "abort", urls: list[str] | None = None) -> list[Any]:
        """Pause every server, or ``urls`` (``abort``: running requests return aborted and
        are resubmitted after :meth:`continue_generation`; ``in_place``: they wait, KV
        kept)."""
        self._resumed.clear()
        self._paused_by_us = True
        return await self._pause(mode, urls)

    async def continue_generation(self, urls: list[str] | None = None) -> list[Any]:
        try:
            return await self._broadcast("/resume", urls=urls)
        finally:
            self._paused_by_us = False
            self._resumed.set()

    async def weights_report(self, url: str) -> WeightsReport:
        """The version the server at ``url`` labels new tokens with (``/weight_info``) and
        the checksum its worker extension computed over the weights it last loaded."""
        info = await self._request("GET", url, "/weight_info")
        label = info.get("weight_version") if isinstance(info, dict) else None
        return WeightsReport(_int_version(str(label), url), self._loaded.get(url))

    async def load_and_tag(self, model_path: str, version: int, urls: list[str]) -> list[Any]:
        """On paused servers ``urls``: load ``model_path``, then label new tokens
        ``version``; each server's worker-extension result of the load (with the checksum
        of what it loaded), in ``urls`` order."""
        if is_adapter_snapshot(model_path):
            path = str(await asyncio.to_thread(peft_dir, model_path))
            results = await asyncio.gather(*(self._load_adapter(u, path) for u in urls))
        else:
            kwargs = {"weights_path": str(model_path)}
            results = await asyncio.gather(*(self._rpc(u, LOAD_METHOD, kwargs) for u in urls))
            if self.lora:  # full weights are served as they are: the zero adapter over them
                await asyncio.gather(*(self._load_base_adapter(u) for u in urls))
        for url, result in zip(urls, results, strict=True):
            self._loaded[url] = result.get("checksum")
        await self._tag(version, urls)
        return list(results)

    async def _load_adapter(self, url: str, path: str) -> dict[str, Any]:
        """Load the PEFT directory ``path`` on the server at ``url`` as :data:`ADAPTER_NAME`
        (replacing the one before), then check that the server lists it from ``path``."""
        await self._rpc(url, LORA_SETUP_METHOD, {})  # no reload per engine step
        body = {"lora_name": ADAPTER_NAME, "lora_path": path, "load_inplace": True}
        try:
            await self._request("POST", url, "/v1/load_lora_adapter", body)
        except ValueError:  # a 200 with vLLM's plain-text "Success: ..." (not JSON)
            pass
        except RolloutServerError as exc:
            if exc.status == 404 and "load_lora_adapter" in str(exc):
                raise RolloutServerError(
                    url,
                    "it serves no dynamic LoRA adapters: start vLLM with --enable-lora "
                    "--max-loras N --max-lora-rank R and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True "
                    "(the launcher does for model.lora; docs/lora.md)",
                    exc.status,
                ) from exc
            raise
        models = await self._request("GET", url, "/v1/models")
        cards = models.get("data") if isinstance(models, dict) else None
        roots = [c.get("root") for c in cards or [] if c.get("id") == ADAPTER_NAME]
        if roots != [path]:
            raise RolloutServerError(
                url, f"the LoRA adapter {ADAPTER_NAME!r} is listed from {roots}, not {path}", 200
            )
        self._adapters[url] = path
        # vLLM packs q/k/v and folds the scale into B: no checksum comparable with the
        # trainer's merged weights; the canary checks what the adapter serves
        return {"success": True, "adapter": path, "checksum": None}

    async def _load_base_adapter(self, url: str) -> None:
        """Serve the zero adapter on ``url`` (the worker extension writes it there)."""
        result = await self._rpc(url, BASE_ADAPTER_METHOD, {})
        await self._load_adapter(url, str(result["path"]))

    async def _ensure_adapter(self, url: str) -> None:
        """Before a request to ``url`` (``lora``): make sure it serves an adapter, the one
        it lists (loaded by another client of the run) or else the zero adapter."""
        if url in self._adapters:
            return
        async with self._adapter_locks.setdefault(url, asyncio.Lock()):
            if url in self._adapters:
                return
            models = await self._request("GET", url, "/v1/models")
            cards = models.get("data") if isinstance(models, dict) else None
            roots = [c.get("root") for c in cards or [] if c.get("id") == ADAPTER_NAME]
            if roots and roots[0]:
                await self._rpc(url, LORA_SETUP_METHOD, {})
                self._adapters[url] = str(roots[0])
            else:
                await self._load_base_adapter(url)

    async def reset_adapter(self, url: str) -> None:
        """Serve the zero adapter on ``url`` (a run's start: version 0 is the base model)."""
        await self._load_base_adapter(url)

    async def _tag(self, version: int, urls: list[str]) -> None:
        await self._broadcast("/update_weight_version", {"new_version": str(version)}, urls)

    @contextlib.asynccontextmanager
    async def _paused_for_load(self, urls: list[str], keep_kv: bool) -> AsyncIterator[None]:
        """Servers ``urls`` paused around a load, unless this client already paused them:
        ``keep`` with ``keep_kv`` (running requests continue under the new weights), else
        ``abort``."""
        if self._paused_by_us:
            yield
            return
        await self._pause("keep" if keep_kv else "abort", urls)
        try:
            yield
        finally:
            await self._broadcast("/resume", urls=urls)

    async def update_weights(
        self,
        model_path: str,
        version: int | None = None,
        urls: list[str] | None = None,
        keep_kv: bool = False,
    ) -> list[Any]:
        """Load ``model_path`` as ``version`` on every server (or on ``urls``), paused
        around the load (:meth:`_paused_for_load`); each server's answer to the load."""
        targets = list(self.urls if urls is None else urls)
        async with self._paused_for_load(targets, keep_kv):
            return await self.load_and_tag(model_path, 0 if version is None else version, targets)

    # ------------------------------------------------------------------ broadcast transport
    async def _rpc(self, url: str, method: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Call the worker extension's ``method`` on the server at ``url``; its result, or a
        RolloutServerError with the error it reported."""
        data = await self._request(
            "POST", url, "/collective_rpc", {"method": method, "kwargs": kwargs}
        )
        results = data.get("results") if isinstance(data, dict) else None
        if not results:
            raise RolloutServerError(url, f"{method}: no result from its worker ({data!r})", 200)
        for result in results:
            if not isinstance(result, dict) or not result.get("success"):
                error = result.get("error") if isinstance(result, dict) else result
                raise RolloutServerError(url, f"{method}: {error}", 200)
        return results[0]

    async def init_weights_update_group(self, url: str, body: dict[str, Any]) -> Any:
        """Have the server at ``url`` join a weight-transfer group (the built-in endpoint's
        body, ``relayrl.sync.transports.broadcast``); returns when it has joined."""
        if body.get("backend", "gloo") != "gloo":
            raise RolloutServerError(
                url, f"backend: {body['backend']!r} is not available on vLLM servers ('gloo')", 400
            )
        keys = ("master_address", "master_port", "rank_offset", "world_size", "group_name")
        kwargs = {k: body[k] for k in keys} | {"timeout_s": float(body.get("timeout_s", 60.0))}
        kwargs["secret"] = body.get("secret")  # the rendezvous secret, not the server's key
        return await self._rpc(url, JOIN_METHOD, kwargs)

    async def update_weights_from_distributed(self, url: str, body: dict[str, Any]) -> Any:
        """Have the server at ``url`` receive a broadcast publication (the built-in endpoint's
        body) and serve it as ``body["version"]``: paused around the load as a disk load is;
        returns when it has loaded it (rank 0 must broadcast meanwhile)."""
        version = int(body.get("version") or 0)
        kwargs = {k: body[k] for k in ("group_name", "names", "dtypes", "shapes")}
        async with self._paused_for_load([url], bool(body.get("keep_kv", False))):
            result = await self._rpc(url, RECEIVE_METHOD, kwargs)
            self._loaded[url] = result.get("checksum")
            await self._tag(version, [url])
        return result | {"weight_version": version}

    # ------------------------------------------------------------------ generation
    PAUSES_TO_LOAD = True  # a load pauses the server around it (relayrl.sync.transaction)
    GENERATE_PATH = "/inference/v1/generate"
    BATCHED_GENERATE = False  # no list form; a group is one request with n (generate_many)

    def generate_body(
        self, input_ids: list[int], sampling_params: SamplingParams | dict[str, Any]
    ) -> dict[str, Any]:
        return self._with_adapter(
            {
                "token_ids": [int(t) for t in input_ids],
                "sampling_params": vllm_sampling_params(_params_dict(sampling_params)),
            }
        )

    def _with_adapter(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` naming the served LoRA adapter (``lora``; else the base model)."""
        return body | {"model": ADAPTER_NAME} if self.lora else body

    async def post_generation(self, url: str, body: dict[str, Any]) -> Any:
        """The base class's, on a server that serves the adapter (``lora``): loaded first
        if this client has not loaded one there, and again (then the request repeated) if
        the server answers that it does not know it (restarted at the same address)."""
        if not self.lora:
            return await super().post_generation(url, body)
        await self._ensure_adapter(url)
        try:
            return await super().post_generation(url, body)
        except RolloutServerError as exc:
            if exc.status != 404 or ADAPTER_NAME not in str(exc):
                raise
        self._adapters.pop(url, None)
        await self._ensure_adapter(url)
        return await super().post_generation(url, body)

    def parse_generation(self, url: str, data: dict[str, Any]) -> Generation:
        return parse_vllm_generation(url, data)

    async def generate_many(
        self,
        input_ids: list[list[int]],
        sampling_params: list[SamplingParams | dict[str, Any]],
        key: str | None = None,
    ) -> list[Generation]:
        """Generate a group to completion on one server: one request with ``n`` when the
        group is one (:func:`group_request`), else one request per sample, concurrently.
        Samples that come back aborted are resubmitted one by one; if the server cannot be
        reached, every sample goes through :meth:`generate` (its failover)."""
        if len(input_ids) != len(sampling_params):
            raise ValueError(f"{len(input_ids)} prompts but {len(sampling_params)} params")
        params = [_params_dict(p) for p in sampling_params]
        body = group_request(input_ids, params) if len(params) > 1 else None
        if body is None or len(params) >= self._refused_n:
            return await self._one_per_sample(input_ids, params, key)
        body = self._with_adapter(body)
        url = self.server_for(key)
        try:
            data = await self.post_generation(url, body)
        except RolloutServerError as exc:
            if exc.status == 400 and "sampling_params.n" in str(exc):  # n > max_num_seqs
                self._refused_n = min(self._refused_n, len(params))
            elif not exc.unreachable or self.recover is None:
                raise
            return await self._one_per_sample(input_ids, params, key)
        firsts = parse_vllm_group(url, data, len(params))
        return list(
            await asyncio.gather(
                *(
                    self._complete(ids, p, url, first)
                    for ids, p, first in zip(input_ids, params, firsts, strict=True)
                )
            )
        )

    async def _one_per_sample(
        self, input_ids: list[list[int]], params: list[dict[str, Any]], key: str | None
    ) -> list[Generation]:
        """A group as concurrent requests, one per sample, to the group's server."""
        pairs = zip(input_ids, params, strict=True)
        return list(await asyncio.gather(*(self.generate(i, p, key) for i, p in pairs)))
