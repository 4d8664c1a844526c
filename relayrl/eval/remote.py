"""Evaluation on rollout servers: :class:`RemoteEngine`, the engine :func:`evaluate` needs
(``submit`` returning a future, ``max_seq_len``, ``weight_version``) over a
:class:`relayrl.engine.client.RolloutClient` of any rollout backend (the built-in
``relayrl serve``, vLLM, servers someone else started).

The client is async; :func:`evaluate` submits from a plain thread and waits on
``concurrent.futures`` futures. So the client lives on an event loop of its own in a
background thread, created there and closed there; :meth:`RemoteEngine.submit` hands each
request to that loop with ``run_coroutine_threadsafe``. Requests go one per server call
through :meth:`RolloutClient.generate` (round-robin over the servers, resubmission after a
pause, the backend's wire protocol) and come back as :class:`GenerationResult`.

``max_seq_len`` is the smallest context of the servers and ``weight_version`` the version
they all serve when the engine connects (servers on different versions are refused: one
evaluation, one version). :func:`evaluate` rejects the evaluation if tokens of another
version come back, i.e. if someone published weights meanwhile.

Which client class speaks which backend is the launcher's business (``relayrl.launch``, a
layer this one may not import): the caller passes a factory.

:meth:`RemoteEngine.sharing` is the other way in, for the training job's evaluation on its
rollout servers (``eval.backend=servers``): the engine borrows the job's own client on the
job's running event loop (so a failed request fails over through the job's supervisor and
rollouts share the servers meanwhile); it neither creates nor closes that client nor the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from relayrl.engine.client import Generation, RolloutClient
from relayrl.engine.types import GenerationResult, SamplingParams
from relayrl.errors import RelayError

T = TypeVar("T")


def generation_result(rid: str, prompt_ids: list[int], out: Generation) -> GenerationResult:
    """A client's :class:`Generation` as the in-process engine's :class:`GenerationResult`."""
    reason = out.finish_reason if out.finish_reason in ("stop", "length", "abort") else "stop"
    return GenerationResult(
        rid=rid,
        prompt_ids=list(prompt_ids),
        output_ids=list(out.output_ids),
        output_logprobs=list(out.output_logprobs),
        output_versions=list(out.output_versions),
        finish_reason=reason,
        prompt_tokens=out.prompt_tokens or len(prompt_ids),
    )


class RemoteEngine:
    """An engine for :func:`relayrl.eval.evaluate.evaluate` backed by rollout servers; use as
    a context manager (or call :meth:`close`). ``make_client`` is called on the engine's
    own event loop, then ``check`` (the backend's protocol check) awaited with the client;
    a server that does not answer raises
    :class:`relayrl.engine.client.RolloutServerError`, servers on different versions
    :class:`RelayError`."""

    def __init__(
        self,
        make_client: Callable[[], RolloutClient],
        check: Callable[[RolloutClient], Coroutine[Any, Any, None]] | None = None,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = threading.Thread(
            target=self._loop.run_forever, daemon=True
        )
        self._thread.start()
        self._rids = itertools.count()
        self.client: RolloutClient | None = None
        try:
            self.client = self._run(self._make(make_client))
            if check is not None:
                self._run(check(self.client))
            self.max_seq_len, self.weight_version = self._run(self._info(self.client))
        except BaseException:
            self.close()
            raise

    @classmethod
    def sharing(cls, client: RolloutClient, loop: asyncio.AbstractEventLoop) -> RemoteEngine:
        """An engine over ``client``, which lives on ``loop``, a loop running in another
        thread (call this from a thread other than ``loop``'s). Closing the engine leaves
        the client and the loop alone."""
        engine = cls.__new__(cls)
        engine._loop, engine._thread = loop, None  # no thread of its own: nothing to stop
        engine._rids = itertools.count()
        engine.client = client
        engine.max_seq_len, engine.weight_version = engine._run(engine._info(client))
        return engine

    async def _make(self, make_client: Callable[[], RolloutClient]) -> RolloutClient:
        return make_client()

    @staticmethod
    async def _info(client: RolloutClient) -> tuple[int, int]:
        infos = await client.serving_info()
        versions = {i.weight_version for i in infos}
        if len(versions) != 1:
            by_url = dict(zip(client.urls, (i.weight_version for i in infos), strict=True))
            raise RelayError(
                f"rollout servers on different weight versions {by_url}: an evaluation "
                "needs one version"
            )
        return min(i.max_seq_len for i in infos), versions.pop()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def submit(
        self, input_ids: list[int], params: SamplingParams | None = None
    ) -> concurrent.futures.Future:
        """Send one request; the future resolves to a :class:`GenerationResult`."""
        if self.client is None:
            raise RuntimeError("RemoteEngine is closed")
        rid = f"eval-{next(self._rids)}"
        return asyncio.run_coroutine_threadsafe(
            self._generate(rid, list(input_ids), params or SamplingParams()), self._loop
        )

    async def _generate(
        self, rid: str, input_ids: list[int], params: SamplingParams
    ) -> GenerationResult:
        assert self.client is not None
        return generation_result(rid, input_ids, await self.client.generate(input_ids, params))

    def close(self) -> None:
        """Close the client and stop the loop (idempotent); an engine made by
        :meth:`sharing` only lets go of the client."""
        if self._thread is None:
            self.client = None
            return
        if self._loop.is_closed():
            return
        if self.client is not None:
            self._run(self.client.close())
            self.client = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> RemoteEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
