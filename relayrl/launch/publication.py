"""Weight publication as a transaction with one owner and one deadline (docs/engine.md
"Publication", docs/cluster.md "Weight transports").

Owns: :class:`Publication` (the trainer side hands it weights; it owns the published
version), :class:`PublicationSteps` (one attempt: pause → load → verify → resume on every
server, each step under a deadline), :class:`PauseWatch` (which servers a publication has
paused, since when: the supervisor's watchdog resumes one paused past the deadline),
:class:`Deadlines`, :class:`PublicationError` and :func:`remove_older_snapshots`.

The transaction, for publication ``v``:

1. **snapshot** (trainer side, the trainer held): the publisher's snapshot and the checksum of
   the weights published (``weights_checksum`` over the snapshot's tensors);
2. **pause** (``train.publish_mode=abort`` only): every server pauses, aborting its running
   requests (the client resubmits them after the resume);
3. **load**: the weight transport puts ``v`` on every server and labels new tokens ``v``
   (``relayrl.launch.publish``; vLLM servers pause around the load themselves);
4. **verify**: each server reports the version it serves and the checksum of the weights it
   loaded (built-in servers: over the model's own parameters; vLLM servers: over the tensors
   the worker extension loaded); a wrong version or checksum fails the publication naming the
   server: a server that kept stale weights under the new label cannot pass;
5. **resume** (any server that may have been paused);
6. **canary** (the first publication, then every ``train.publish_canary_every``-th): each
   server samples a few tokens after a fixed prompt, and their logprobs must equal the
   trainer's under the published weights (a copy of the trainer's model taken with the
   snapshot) within ``train.publish_canary_tolerance``: the checksum proves the weights
   were delivered, the canary that the server samples from them (e.g. a load that reached
   the checkpoint tensors but not a tied LM head's cached GEMM handle). The checksum catches
   a one-step-stale server exactly; the canary only a difference above its tolerance.
   A server the canary cannot reach is restarted by the supervisor (loading this
   publication) and the canary runs again, as a request fails over.

Every step runs per server under ``min(train.publish_step_timeout_s, what is left of
train.publish_timeout_s)``; a step past it is *not awaited further* (its task is cancelled
and left behind, so no wait of the run is unbounded). Every exit path resumes what may be
paused: success (the resume step), an error or a timeout (the servers are resumed under the
step deadline; one that cannot be resumed is reported in :attr:`PublicationSteps.unresumed`,
which the supervisor restarts), a cancellation (the run ending: resumed under the deadline,
best effort), a server restarted mid-way (the supervisor repeats the whole transaction on
the new server list; a fresh server is not paused). A failure other than an unreachable
server (which the supervisor restarts, then repeats the publication) is one
:class:`PublicationError`: ``publication of weights v7: rollout server URL: load step: ...``.

Imports: relayrl.engine.client, relayrl.engine.weights, relayrl.launch.publish,
relayrl.errors.
"""

from __future__ import annotations

import asyncio
import copy
import shutil
import sys
import threading
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from relayrl.engine.adapter import is_adapter_snapshot, read_adapter
from relayrl.engine.client import RolloutClient, RolloutServerError
from relayrl.engine.weights import read_state_dict, weights_checksum
from relayrl.errors import RelayError
from relayrl.launch.publish import Snapshot, WeightPublisher, WeightSource

if TYPE_CHECKING:
    from relayrl.launch.supervisor import ServerSupervisor

STEPS = ("snapshot", "pause", "load", "verify", "resume", "canary")
CANARY_PROMPT = [3, 4, 5, 6, 7, 8, 9, 10]  # token ids: any model's vocabulary has them
CANARY_TOKENS = 8
CANARY_SEED = 1234
CANARY_FAILOVERS = 8  # canary rounds repeated after a server was found unreachable


@dataclass(frozen=True)
class Canary:
    """``every``: the canary runs on the first publication and then every ``every``-th
    (``train.publish_canary_every``, 0 = never); ``tolerance``: the largest |Δ logprob|
    (nats) allowed between a server's and the trainer's for the same weights
    (``train.publish_canary_tolerance``)."""

    every: int = 10
    tolerance: float = 1e-2

    def due(self, index: int) -> bool:
        return self.every > 0 and index % self.every == 0


def reference_logprobs(
    model: torch.nn.Module, prompt: list[int], output: list[int], temperature: float = 1.0
) -> list[float]:
    """The trainer's view of a sample: ``log_softmax(logits / T)`` of each output token."""
    device = next(model.parameters()).device
    with torch.no_grad():
        ids = torch.tensor([prompt + output], device=device)
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        picked = logp.gather(-1, torch.tensor(output, device=device)[:, None])[:, 0]
    return [float(x) for x in picked.cpu()]


@dataclass(frozen=True)
class Deadlines:
    """``step_s``: each step of a publication (``train.publish_step_timeout_s``);
    ``total_s``: the whole of one attempt (``train.publish_timeout_s``)."""

    step_s: float = 300.0
    total_s: float = 900.0

    def __post_init__(self) -> None:
        if self.step_s <= 0 or self.total_s <= 0:
            raise ValueError(f"deadlines must be > 0, got {self}")


class PublicationError(RelayError):
    """A publication failed: names the version, the step and the server(s)."""

    def __init__(self, version: int, step: str, servers: list[str], why: str) -> None:
        where = ", ".join(servers) if servers else "every server"
        super().__init__(
            f"publication of weights v{version}: rollout server(s) {where}: {step} step: {why}"
        )
        self.version, self.step, self.servers = version, step, list(servers)


def remove_older_snapshots(root: Path, version: int) -> list[Path]:
    """Delete the published weight snapshots ``root/v<k>`` with ``k < version`` (the servers
    have loaded ``version``); nothing else under ``root`` is touched. Returns what went."""
    removed = []
    for old in root.glob("v*"):
        if old.is_dir() and old.name[1:].isdigit() and int(old.name[1:]) < version:
            shutil.rmtree(old, ignore_errors=True)
            removed.append(old)
    return sorted(removed)


def snapshot_checksum(snapshot: Snapshot, served_dtype: torch.dtype | None = None) -> str | None:
    """``weights_checksum`` of what ``snapshot`` publishes (its tensors, else its disk
    snapshot's; an adapter snapshot's: the merged weights' the trainer recorded in it), None
    when it holds neither. ``served_dtype``: the servers hold the weights in this dtype
    (``rollout.dtype``), so the checksum is of the tensors rounded to it, as loading does."""
    if snapshot.adapter is not None:
        return snapshot.adapter.checksum
    if snapshot.path is not None and is_adapter_snapshot(snapshot.path):
        return read_adapter(snapshot.path).checksum
    if snapshot.state is not None:
        state = snapshot.state
    elif snapshot.path is not None:
        state = read_state_dict(snapshot.path)
    else:
        return None
    if served_dtype is None:
        return weights_checksum(state.items())
    return weights_checksum((name, t.to(served_dtype)) for name, t in state.items())


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # a step left behind: its outcome is superseded


@dataclass
class PauseWatch:
    """The servers a publication may have paused: URL -> (since, version, step)."""

    paused: dict[str, tuple[float, int, str]] = field(default_factory=dict)

    def mark(self, urls: list[str], version: int, step: str) -> None:
        now = time.monotonic()
        for url in urls:
            self.paused.setdefault(url, (now, version, step))

    def clear(self, urls: list[str]) -> None:
        for url in urls:
            self.paused.pop(url, None)

    def overdue(self, limit_s: float) -> dict[str, tuple[float, int, str]]:
        """The servers paused for longer than ``limit_s``: URL -> (seconds, version, step)."""
        now = time.monotonic()
        return {
            url: (now - since, version, step)
            for url, (since, version, step) in self.paused.items()
            if now - since > limit_s
        }


class PublicationSteps:
    """One attempt of a publication on one client; see the module docstring."""

    def __init__(
        self,
        publisher: WeightPublisher,
        mode: str,
        deadlines: Deadlines | None = None,
        verify: bool = True,
    ) -> None:
        self.publisher = publisher
        self.mode = mode
        self.deadlines = deadlines or Deadlines()
        self.verify = verify
        self.watch = PauseWatch()
        self.unresumed: list[str] = []  # servers the last failed attempt could not resume

    async def run(self, client: RolloutClient, snapshot: Snapshot) -> None:
        """Publish ``snapshot`` on every server of ``client``, or raise (see the module
        docstring: a :class:`RolloutServerError` for an unreachable server, else a
        :class:`PublicationError`)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.deadlines.total_s
        urls, version = list(client.urls), snapshot.version
        self.unresumed = []
        resumed = False
        try:
            if self.mode == "abort":
                self.watch.mark(urls, version, "pause")
                await self._step(
                    end, version, "pause", {u: client.pause("abort", [u]) for u in urls}
                )
            if getattr(client, "PAUSES_TO_LOAD", False):
                self.watch.mark(urls, version, "load")
            await self._step(end, version, "load", self._load_calls(client, snapshot))
            if self.mode != "abort":  # a client that paused to load has resumed by now
                self.watch.clear(urls)
            if self.verify:
                calls = {u: self._verify(client, u, snapshot) for u in urls}
                await self._step(end, version, "verify", calls)
            await self._resume(end, client, version, urls)
            resumed = True
        finally:
            if not resumed:
                await self._resume_after_failure(client, version, urls)

    def _load_calls(self, client: RolloutClient, snapshot: Snapshot) -> dict[str, Awaitable]:
        return self.publisher.load_calls(client, snapshot, keep_kv=self.mode == "inflight")

    async def _verify(self, client: RolloutClient, url: str, snapshot: Snapshot) -> None:
        report = await client.weights_report(url)
        if report.version != snapshot.version:
            raise PublicationError(
                snapshot.version, "verify", [url], f"it serves version {report.version}"
            )
        expected = snapshot.checksum
        if expected is not None and report.checksum is not None and report.checksum != expected:
            raise PublicationError(
                snapshot.version,
                "verify",
                [url],
                f"it loaded weights with checksum {report.checksum[:16]}…, not the "
                f"published {expected[:16]}… (stale or partial weights under the new label)",
            )

    async def _resume(self, end: float, client: RolloutClient, version: int, urls: list[str]):
        paused = [u for u in urls if u in self.watch.paused]
        if paused:
            calls = {u: client.continue_generation([u]) for u in paused}
            await self._step(end, version, "resume", calls)
            self.watch.clear(paused)

    async def _resume_after_failure(
        self, client: RolloutClient, version: int, urls: list[str]
    ) -> None:
        """The exit path of a failed, timed-out or cancelled attempt: resume every server it
        may have paused, under one step deadline; those that cannot be resumed are left in
        :attr:`unresumed` (the supervisor restarts them)."""
        paused = [u for u in urls if u in self.watch.paused and u in client.urls]
        self.watch.clear([u for u in urls if u not in client.urls])  # replaced meanwhile
        if not paused:
            return
        tasks = {asyncio.ensure_future(client.continue_generation([u])): u for u in paused}
        done, pending = await asyncio.wait(tasks, timeout=self.deadlines.step_s)
        for task in pending:
            task.cancel()
            task.add_done_callback(_retrieve)
        ok = [tasks[t] for t in done if not t.cancelled() and t.exception() is None]
        self.watch.clear(ok)
        self.unresumed = [u for u in paused if u not in ok]
        if self.unresumed:
            print(
                f"warning: publication v{version}: could not resume {', '.join(self.unresumed)} "
                "after the publication failed; restarting it",
                file=sys.stderr,
                flush=True,
            )

    async def _step(
        self, end: float, version: int, step: str, calls: Mapping[str, Awaitable[Any]]
    ) -> None:
        """Run one step's per-server ``calls`` (label -> awaitable) under its deadline."""
        limit = min(self.deadlines.step_s, end - asyncio.get_running_loop().time())
        tasks = {asyncio.ensure_future(c): label for label, c in calls.items()}
        if limit <= 0:
            done, pending = set(), set(tasks)
        else:
            done, pending = await asyncio.wait(
                tasks, timeout=limit, return_when=asyncio.FIRST_EXCEPTION
            )
        for task in pending:
            task.cancel()
            task.add_done_callback(_retrieve)
        errors = [(tasks[t], t.exception()) for t in done if not t.cancelled() and t.exception()]
        for _, exc in errors:
            if isinstance(exc, RolloutServerError) and exc.unreachable:
                raise exc  # the supervisor restarts the server and repeats the publication
        for label, exc in errors:
            if isinstance(exc, PublicationError):
                raise exc
            raise PublicationError(version, step, [label], str(exc)) from exc
        if pending:
            which = (
                f"train.publish_step_timeout_s={self.deadlines.step_s:g}"
                if limit >= self.deadlines.step_s
                else f"train.publish_timeout_s={self.deadlines.total_s:g} (the whole publication)"
            )
            raise PublicationError(
                version, step, [tasks[t] for t in pending], f"no answer within {which}"
            )


class PublicationListener(Protocol):
    """Who hears of publications (the rollout controller): its admission bound moves up
    when the servers serve a version; a failure stops the run."""

    def set_published_version(self, version: int) -> None: ...

    def fail(self, exc: BaseException) -> None: ...


class Publication:
    """The owner of the published version, on the trainer's side: :meth:`submit` takes the
    trainer's weights (the snapshot, while the trainer is held) and puts them on the
    servers in the background, one publication after the other, through the supervisor
    (which serialises them with restarts and runs :class:`PublicationSteps`)."""

    def __init__(
        self,
        supervisor: ServerSupervisor,
        publisher: WeightPublisher,
        root: Path,
        listener: PublicationListener,
        canary: Canary | None = None,
        served_dtype: torch.dtype | None = None,
    ) -> None:
        self.supervisor, self.publisher, self.root = supervisor, publisher, root
        # the servers' weights dtype when it is not the trainer's (rollout.dtype): the
        # checksum and the canary's reference are of the weights rounded to it
        self.served_dtype = served_dtype
        self.listener = listener
        self.canary = canary or Canary(every=0)
        self.canaries = 0  # canaries run
        self.canary_seconds = 0.0  # their time in all
        self.canary_max_diff = 0.0  # the largest |Δ logprob| a canary saw
        self._reference_lock = threading.Lock()  # canaries share the reference model
        self._task: asyncio.Task | None = None
        self.last_seconds = 0.0  # how long the last finished publication took
        self.count = 0
        self.total_seconds = 0.0

    async def submit(self, trainer: WeightSource, version: int, wait: bool = False) -> float:
        """Snapshot ``trainer``'s weights as ``version`` and publish them in the background
        (after the previous publication: versions arrive in order); ``wait``: until the
        servers serve it. Returns the seconds the trainer was held (the snapshot, plus the
        previous publication if it was still loading)."""
        start = time.perf_counter()
        await self.finish()
        snapshot, reference = await asyncio.to_thread(self._snapshot, trainer, version)
        self._task = asyncio.create_task(
            self._publish(snapshot, reference), name=f"publish-v{version}"
        )
        if wait:
            await self.finish()
        return time.perf_counter() - start

    def _snapshot(
        self, trainer: WeightSource, version: int
    ) -> tuple[Snapshot, torch.nn.Module | None]:
        """The publisher's snapshot with its checksum, and a copy of the trainer's model when
        this publication runs the canary (the trainer trains on meanwhile)."""
        snapshot = self.publisher.snapshot(trainer, self.root, version)
        if self.supervisor.steps.verify:
            snapshot.checksum = snapshot_checksum(snapshot, self.served_dtype)
        reference = None
        if self.canary.due(self.count):
            try:
                reference = copy.deepcopy(trainer.model).eval()
                if self.served_dtype is not None:
                    reference = reference.to(self.served_dtype)
            except Exception as exc:  # noqa: BLE001 - e.g. a sharded model: no canary
                print(f"warning: no canary ({exc!r})", file=sys.stderr, flush=True)
                self.canary = Canary(every=0)
        return snapshot, reference

    async def _publish(self, snapshot: Snapshot, reference: torch.nn.Module | None) -> None:
        start, version = time.perf_counter(), snapshot.version
        try:
            await self.supervisor.publish(
                snapshot.path,
                version,
                snapshot.state,
                checksum=snapshot.checksum,
                adapter=snapshot.adapter,
            )
            if reference is not None:
                await self._run_canary(version, reference)
        except Exception as exc:  # the trainer learns of it from its next batch
            self.listener.fail(exc)
            raise
        self.listener.set_published_version(version)
        self.last_seconds = time.perf_counter() - start
        self.count += 1
        self.total_seconds += self.last_seconds
        if self.supervisor.latest is not None:  # keep the newest disk snapshot (restarts)
            remove_older_snapshots(self.root, self.supervisor.latest[1])

    async def _run_canary(self, version: int, reference: torch.nn.Module) -> None:
        """Each server samples :data:`CANARY_TOKENS` tokens after a fixed prompt; their
        logprobs must equal the trainer's under the published weights (``reference``)
        within the tolerance, and carry ``version``. Under the step deadline.

        A server found unreachable fails over as a request does: the supervisor restarts
        it (the replacement loads this publication, the newest) and the canary runs again
        on every server, at most :data:`CANARY_FAILOVERS` times; the supervisor's limit on
        restarts still ends the run. (Raised as is, a server lost just after the load
        stopped the run while the supervisor was restarting it.)"""
        start = time.perf_counter()
        for failovers in range(CANARY_FAILOVERS + 1):
            try:
                await self._canary_round(version, reference)
                break
            except RolloutServerError as exc:
                if not exc.unreachable or failovers == CANARY_FAILOVERS:
                    raise
                await self.supervisor.recover(exc.url)
        self.canaries += 1
        self.canary_seconds += time.perf_counter() - start

    async def _canary_round(self, version: int, reference: torch.nn.Module) -> None:
        """One canary on every current server, under one step deadline."""
        client = self.supervisor.client
        steps = self.supervisor.steps
        end = asyncio.get_running_loop().time() + steps.deadlines.step_s
        calls = {u: self._canary_on(client, u, version, reference) for u in client.urls}
        await steps._step(end, version, "canary", calls)

    async def _canary_on(
        self, client: Any, url: str, version: int, reference: torch.nn.Module
    ) -> None:
        params = {
            "max_new_tokens": CANARY_TOKENS,
            "temperature": 1.0,
            "seed": CANARY_SEED,
            "ignore_eos": True,
        }
        out = await client.generate_once(list(CANARY_PROMPT), params, url=url)
        if not out.output_ids or any(v != version for v in out.output_versions):
            raise PublicationError(
                version,
                "canary",
                [url],
                f"{len(out.output_ids)} tokens labelled {sorted(set(out.output_versions))}",
            )
        expected, base = await asyncio.to_thread(self._reference_view, reference, out.output_ids)
        pairs = zip(out.output_logprobs, expected, strict=True)
        diff = max(abs(a - b) for a, b in pairs)
        self.canary_max_diff = max(self.canary_max_diff, diff)
        if base is not None:
            self._adapter_applied(url, version, out.output_logprobs, expected, base)
        if diff > self.canary.tolerance:
            raise PublicationError(
                version,
                "canary",
                [url],
                f"its logprobs of a fixed prompt differ from the trainer's for the same weights "
                f"by up to {diff:.3g} nats (> train.publish_canary_tolerance="
                f"{self.canary.tolerance:g}): it does not serve the published weights",
            )

    def _reference_view(
        self, reference: torch.nn.Module, output: list[int]
    ) -> tuple[list[float], list[float] | None]:
        """The trainer's logprobs of a canary's ``output`` and, for a peft (LoRA) policy, the
        base model's (its adapters disabled). One server's canary at a time: disabling the
        adapters changes the shared model, so a concurrent canary computed without the lock
        saw the base model as the trainer's."""
        prompt = list(CANARY_PROMPT)
        with self._reference_lock:
            expected = reference_logprobs(reference, prompt, list(output))
            if getattr(reference, "disable_adapter", None) is None:
                return expected, None
            with reference.disable_adapter():
                return expected, reference_logprobs(reference, prompt, list(output))

    def _adapter_applied(
        self,
        url: str,
        version: int,
        served_logprobs: list[float],
        expected: list[float],
        base: list[float],
    ) -> None:
        """A LoRA policy's canary: where the trainer's logprobs differ from the base model's
        by more than the tolerance, the server's must too; a server that matches the base
        there serves the base model, not the adapter (issue 32: an adapter never applied)."""
        adapted = max(abs(a - b) for a, b in zip(expected, base, strict=True))
        served = max(abs(a - b) for a, b in zip(served_logprobs, base, strict=True))
        tolerance = self.canary.tolerance
        if adapted > tolerance and served <= tolerance:
            raise PublicationError(
                version,
                "canary",
                [url],
                f"it serves the base model, not the published LoRA adapter: its logprobs of a "
                f"fixed prompt equal the base model's (max |Δ| {served:.3g} nats) where the "
                f"trainer's differ from them by up to {adapted:.3g} nats",
            )

    async def finish(self, timeout: float | None = None) -> None:
        """Wait for the publication in flight, if any (its error already reached the
        listener); at most ``timeout`` seconds (the publication bounds itself anyway: its
        deadlines). One still running past ``timeout`` is cancelled and left behind."""
        task, self._task = self._task, None
        if task is None:
            return
        await asyncio.wait({task}, timeout=timeout)
        if not task.done():
            task.cancel()
            task.add_done_callback(_retrieve)
            print(
                f"warning: publication {task.get_name()} did not end within {timeout:g}s; "
                "left behind",
                file=sys.stderr,
                flush=True,
            )
        else:
            _retrieve(task)

    async def close(self, timeout: float) -> None:
        """The run is ending: cancel the publication in flight (it resumes what it paused,
        under its step deadline) and wait for it at most ``timeout`` seconds."""
        if self._task is not None:
            self._task.cancel()
        await self.finish(timeout)

    def stats(self) -> dict[str, float]:
        """The canary's counters for the run's summary (none when it never ran)."""
        if not self.canaries:
            return {}
        return {
            "publish_canaries": float(self.canaries),
            "publish_canary_mean_s": self.canary_seconds / self.canaries,
            "publish_canary_max_logprob_diff": self.canary_max_diff,
        }


__all__ = [
    "STEPS",
    "Canary",
    "Deadlines",
    "PauseWatch",
    "Publication",
    "PublicationError",
    "PublicationListener",
    "PublicationSteps",
    "remove_older_snapshots",
    "snapshot_checksum",
]
