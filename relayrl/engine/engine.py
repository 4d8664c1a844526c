"""The built-in generation engine: a continuous-batching scheduler over any Hugging Face causal
LM with per-token logprobs and weight versions, interruptible weight updates and pausing.

Threading: one background thread (the *loop*) owns the model, the KV cache and every request
table. Other threads talk to it only through a command queue (``_call``), so no table is ever
touched concurrently. ``submit`` returns a ``concurrent.futures.Future``; ``generate`` is its
asyncio twin for the HTTP server.

Scheduling, per loop iteration: run queued commands; admit waiting requests into free KV slots
(FIFO, bounded by ``max_running_requests``, the KV memory budget and ``max_prefill_tokens``)
and prefill them as one left-padded batch, a group's identical prompts computed once; then decode one token for every running request in
one batched forward. Finished requests leave their slot at once, so a long request never
blocks the admission of new ones.

Weight updates run between two steps. By default KV computed under old weights is never
reused: every running request is *retracted* (its slot freed, it goes back to the head of the
queue with its partial output) and is prefilled again, prompt + partial output, under the new
weights. ``keep_kv=True`` asks for the opposite explicitly (PipelineRL's in-flight update):
running requests keep their KV and decode on under the new weights. Tokens keep the version
of the weights that produced them.

Layout (nano-vllm's): this module is the public API and the loop thread; what runs is the
:class:`~relayrl.engine.scheduler.Scheduler`'s, how it runs the
:class:`~relayrl.engine.model_runner.ModelRunner`'s, and a request's state is a
:class:`~relayrl.engine.sequence.Sequence`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Sequence_
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import torch

from relayrl.engine.adapter import (
    Adapter,
    AdapterBase,
    check_adapter_shapes,
    is_adapter_snapshot,
    merged_checksum,
    read_adapter,
)
from relayrl.engine.model_runner import ModelRunner, eos_ids
from relayrl.engine.scheduler import Scheduler
from relayrl.engine.sequence import Sequence, TokenListener, stop_reason
from relayrl.engine.types import (
    MAX_TOP_LOGPROBS,
    PAUSE_MODES,
    EngineOptions,
    FinishReason,
    GenerationResult,
    PauseMode,
    SamplingParams,
)
from relayrl.engine.versioned import VersionedAdapters
from relayrl.engine.weights import check_shapes, model_checksum, read_state_dict
from relayrl.errors import RelayError
from relayrl.heap import peak_rss_mb, release_free_heap

P = ParamSpec("P")
R = TypeVar("R")


class Engine:
    """Continuous-batching generation over a Hugging Face causal LM; see the module docstring.

    ``model`` is used as is (device and dtype included); ``tokenizer`` is optional and only
    needed for ``stop`` strings. Call ``shutdown()`` (or use as a context manager) to stop
    the loop thread.
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        options: EngineOptions | None = None,
        model_path: str | None = None,
    ) -> None:
        self.options = options or EngineOptions()
        self.tokenizer = tokenizer
        self.model_path = model_path
        self._stats = {
            "peak_running": 0,
            "steps": 0,
            "prefills": 0,
            "generated_tokens": 0,
            "aborted": 0,
            # prefill work: tokens prefilled, the same with the batch's left padding, and the
            # part that recomputes KV of retracted requests (what a weight update costs)
            "prefill_tokens": 0,
            "prefill_padded_tokens": 0,
            "retracted": 0,
            "reprefill_tokens": 0,
            # running requests that kept KV built under older weights (keep_kv updates)
            "kept_kv": 0,
            # running requests an adapter publication left decoding under their own version
            # (max_adapters >= 2: nothing retracted, no KV recomputed)
            "kept_version": 0,
            # admissions deferred because the running requests filled the KV budget
            "kv_budget_waits": 0,
            # prefill tokens not computed: a group's identical prompts prefilled once, their
            # KV copied to the other rows (ModelRunner.prefill)
            "shared_prefill_tokens": 0,
        }
        self.runner = ModelRunner(model, self.options, self._stats)
        self.adapter_base = AdapterBase()  # pristine base weights under adapter publications
        # K >= 2: the last K adapters applied per request instead of merged (docs/lora.md)
        self.versions = (
            VersionedAdapters(self.runner.model, self.options.max_adapters)
            if self.options.max_adapters >= 2
            else None
        )
        self.model, self.device, self.cache = (
            self.runner.model,
            self.runner.device,
            self.runner.cache,
        )
        self.vocab_size, self.max_seq_len = self.runner.vocab_size, self.runner.max_seq_len
        self.num_slots = self.runner.num_slots
        self.kv_budget_tokens = self.runner.kv_budget_tokens
        self.scheduler = Scheduler(
            self.cache,
            self.num_slots,
            self.options.max_prefill_tokens,
            self._stats,
            self.kv_budget_tokens,
        )
        self.eos_ids = eos_ids(model, tokenizer)
        self._weight_version = self.options.weight_version
        self._base_version = self._weight_version  # the version of the weights themselves
        self._paused = False
        self._step_error: str | None = None  # the last step's failure, until a step succeeds
        self._rid_counter = itertools.count()
        self._commands: queue.Queue = queue.Queue()
        self._shutdown = False
        self._threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._loop, name="relayrl-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, path: str | Path, options: EngineOptions | None = None) -> Engine:
        """Load a Hugging Face model directory (model + tokenizer) onto ``options.device``."""
        from relayrl.models.loading import load_model, load_tokenizer

        options = options or EngineOptions()
        model = load_model(path, device=options.device, dtype=options.dtype)
        try:
            tokenizer = load_tokenizer(path)
        except RelayError:
            tokenizer = None
        return cls(model, tokenizer, options, model_path=str(path))

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ public API
    @property
    def weight_version(self) -> int:
        return self._weight_version

    def validate(self, input_ids: list[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` naming the bad field of a request."""
        params.validate()
        if not input_ids:
            raise ValueError("input_ids must not be empty")
        bad = [t for t in input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"input_ids contains ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
            )
        total = len(input_ids) + params.max_new_tokens
        if total > self.max_seq_len:
            raise ValueError(
                f"len(input_ids) + max_new_tokens = {total} exceeds the engine's max_seq_len "
                f"{self.max_seq_len}"
            )
        if not self.scheduler.fits_kv_budget(1, total):
            raise ValueError(
                f"len(input_ids) + max_new_tokens = {total} exceeds the engine's KV budget of "
                f"{self.kv_budget_tokens} tokens (max_total_tokens, or kv_memory_fraction of "
                "the memory available at start)"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none")

    def submit(
        self,
        input_ids: list[int],
        params: SamplingParams | None = None,
        rid: str | None = None,
        on_token: TokenListener | None = None,
        top_logprobs: int = 0,
    ) -> concurrent.futures.Future:
        """Queue a request; the future resolves to a :class:`GenerationResult`.

        ``on_token(id, logprob, version, top)`` is called on the loop thread for each token
        as it is sampled (streaming); it must hand the token over without blocking.
        ``top_logprobs``: record the k most likely tokens of every step (``top``)."""
        params = params or SamplingParams()
        input_ids = [int(t) for t in input_ids]
        self.validate(input_ids, params)
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}")
        rid = rid or f"req-{next(self._rid_counter)}"
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(7), "little")
        generator = None
        if not params.greedy:
            # CPU generators on every device: one host draw per token, no device sync.
            generator = torch.Generator()
            generator.manual_seed(seed)
        request = Sequence(
            rid=rid,
            prompt_ids=input_ids,
            params=params,
            future=concurrent.futures.Future(),
            generator=generator,
            stop_ids=set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids),
            submitted_at=time.perf_counter(),
            on_token=on_token,
            top_logprobs=top_logprobs,
        )
        self._call(self._add, request, wait=False)
        return request.future

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams | None = None,
        rid: str | None = None,
        on_token: TokenListener | None = None,
        top_logprobs: int = 0,
    ) -> GenerationResult:
        """Async submit-and-wait; cancelling the awaiting task aborts the request."""
        rid = rid or f"req-{next(self._rid_counter)}"
        future = self.submit(input_ids, params, rid, on_token, top_logprobs)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self._call(self._abort_one, rid, wait=False)  # never block the event loop
            raise

    def generate_batch(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[GenerationResult]:
        """Submit all prompts at once and wait for every result (blocking helper)."""
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        futures = [self.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
        return [f.result() for f in futures]

    def score(
        self, input_ids: list[int], temperature: float = 1.0, version: int | None = None
    ) -> list[float]:
        """The logprob of every input token after the first given the ones before it,
        ``log_softmax(logits / T)`` of one plain forward pass (no KV slot, no sampling): what
        a teacher server returns for given tokens (SGLang's input-token logprobs). Runs on
        the loop thread between two steps; ``len(input_ids) − 1`` values. ``version``: under
        one of the versions this engine serves (``versions_served``; None: the newest), e.g.
        the exact behaviour logprobs of an older kept adapter."""
        ids = [int(t) for t in input_ids]
        if len(ids) < 2:
            raise ValueError("input_ids needs at least 2 tokens to score")
        if len(ids) > self.max_seq_len:
            raise ValueError(f"len(input_ids) = {len(ids)} exceeds max_seq_len {self.max_seq_len}")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(
                f"input_ids contains ids outside the vocabulary [0, {self.vocab_size})"
            )
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 to score tokens, got {temperature}")
        return self._call(self._score, ids, temperature, version)

    def versions_served(self) -> list[int]:
        """The weight versions a request or a score can run under now: the newest only, or
        with ``max_adapters`` K >= 2 the base's and the K kept adapters' (oldest first)."""
        return self._call(self._versions_served)

    def _versions_served(self) -> list[int]:
        if self.versions is None:
            return [self._weight_version]
        return sorted({self._base_version, *self.versions.versions})

    def _score(self, ids: list[int], temperature: float, version: int | None) -> list[float]:
        if version is not None and version not in self._versions_served():
            raise ValueError(
                f"weight version {version} is not served (served: {self._versions_served()})"
            )
        if self.versions is not None:
            self.versions.route([self._weight_version if version is None else version])
        x = torch.tensor([ids], dtype=torch.long, device=self.runner.device)
        logits = self.runner.model(input_ids=x, use_cache=False).logits[0, :-1].float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        return logp.gather(-1, x[0, 1:, None])[:, 0].tolist()

    def abort(self, rid: str) -> bool:
        """Abort one request (queued or running); True if it was still live."""
        return self._call(self._abort_one, rid)

    async def run_async(self, method: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Await a blocking engine method (``engine.pause``, ``engine.update_weights``...) off
        the event loop: ``await engine.run_async(engine.pause, PauseMode.ABORT)``."""
        return await asyncio.to_thread(method, *args, **kwargs)

    def pause(self, mode: PauseMode | str = PauseMode.ABORT) -> list[GenerationResult]:
        """Stop generating until :meth:`continue_generation`; new requests queue meanwhile.

        ``abort``: every running and queued request returns now with finish_reason "abort"
        and its partial output (returned here too). ``retract``: running requests free their
        KV and go back to the queue; they are prefilled again (prompt + partial output) on
        resume. ``in_place``: requests keep their KV and simply wait (a weight update while
        paused retracts them, see :meth:`update_weights`).
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        return self._call(self._pause, PauseMode(mode))

    def continue_generation(self) -> None:
        self._call(self._set_paused, False)

    @property
    def paused(self) -> bool:
        return self._paused

    def health_problem(self) -> str | None:
        """Why this engine cannot serve now, or None: its loop has stopped, or its last step
        failed (every request in it got the error; a later step that succeeds clears it).
        What ``GET /health`` reports; read from any thread without waiting on the loop."""
        if self._shutdown or not self._thread.is_alive():
            return "the engine's loop has stopped"
        error = self._step_error
        if error is not None:
            return f"the engine's last step failed ({error}); its requests failed with it"
        return None

    def update_weights(
        self,
        source: str | Path | Mapping[str, torch.Tensor] | Adapter,
        version: int | None = None,
        keep_kv: bool = False,
    ) -> int:
        """Load new weights between two decode steps; returns the new weight version.

        ``source``: a safetensors file, a directory of safetensors shards (a Hugging Face
        model directory), an in-memory state dict, or a LoRA adapter (an adapter snapshot
        directory or an :class:`Adapter`: merged into a copy of the base, docs/lora.md). ``version``: the version to tag new tokens
        with (the trainer's optimizer step); None increments the current one. Running
        requests are retracted and prefilled again under the new weights (no stale KV), unless
        ``keep_kv``: then they keep the KV of their prompt and earlier tokens, built under
        older weights, and decode on under the new ones (no re-prefill; counted in
        ``kept_kv``). Either way the logprobs returned are those of the distribution each
        token was sampled from.
        """
        if isinstance(source, Adapter):  # a LoRA publication by broadcast
            return self._call(self._apply_adapter, source, version, keep_kv)
        if not isinstance(source, Mapping) and is_adapter_snapshot(source):
            adapter = read_adapter(source)  # a LoRA publication: merged into a copy (docs/lora.md)
            return self._call(self._apply_adapter, adapter, version, keep_kv)
        state = source if isinstance(source, Mapping) else read_state_dict(source)
        loaded = self._call(self._update_weights, state, version, keep_kv)
        del state
        release_free_heap()  # the read weights, freed after the copy (relayrl.heap)
        return loaded

    def check_weight_shapes(self, shapes: Mapping[str, Sequence_[int]]) -> None:
        """RelayError unless ``shapes`` (name -> shape) matches the model's tensors: checked
        before a broadcast update receives anything (shapes never change, so any thread)."""
        check_shapes(self.runner.model, {name: tuple(shape) for name, shape in shapes.items()})

    def check_adapter_shapes(self, shapes: Mapping[str, Sequence_[int]]) -> None:
        """RelayError unless ``shapes`` (name -> shape) is a LoRA adapter that fits the
        model: checked before a broadcast adapter receives anything."""
        check_adapter_shapes(self.runner.model, shapes)

    def weights_checksum(self) -> str:
        """SHA-256 of the weights now loaded (``relayrl.engine.weights.weights_checksum``),
        taken on the loop thread between two decode steps."""
        return self._call(self._checksum)

    def _checksum(self) -> str:
        newest = self.versions.adapters.get(self._weight_version) if self.versions else None
        if newest is None:
            return model_checksum(self.runner.model)
        # the weights new requests are served with: the base with the newest adapter merged
        # the way the trainer merges it (the adapter is applied unmerged; the canary checks
        # that it is applied)
        return merged_checksum(self.runner.model.named_parameters(), newest)

    def stats(self) -> dict[str, Any]:
        """Counters and the sizes of the request tables (read on the loop thread)."""
        return self._call(self._stats_now)

    def shutdown(self) -> None:
        """Abort everything still live and stop the loop thread."""
        if self._thread.is_alive():
            self._call(self._stop)
            self._thread.join(timeout=30)

    # ------------------------------------------------------------------ loop plumbing
    def _call(self, fn: Callable, *args, wait: bool = True):
        """Run ``fn(*args)`` on the loop thread; return its result (``wait``) or a future."""
        if self._shutdown or not self._thread.is_alive():
            raise RuntimeError("the engine has been shut down")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, args, done))
        return done.result() if wait else done

    def _run_command(self, item) -> None:
        fn, args, done = item
        try:
            done.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            done.set_exception(exc)

    def _busy(self) -> bool:
        return not self._paused and self.scheduler.has_work()

    def _loop(self) -> None:
        torch.set_num_threads(self._threads)
        with torch.inference_mode():
            while not self._shutdown:
                if not self._busy():
                    self._run_command(self._commands.get())
                while not self._shutdown:
                    try:
                        self._run_command(self._commands.get_nowait())
                    except queue.Empty:
                        break
                if self._busy() and not self._shutdown:
                    self._guarded_step()
        self._refuse_pending_commands()

    def _refuse_pending_commands(self) -> None:
        while True:
            try:
                _, _, done = self._commands.get_nowait()
            except queue.Empty:
                return
            done.set_exception(RuntimeError("the engine has been shut down"))

    def _guarded_step(self) -> None:
        try:
            self.step()
        except Exception as exc:  # noqa: BLE001 - fail the requests, keep serving
            self._step_error = " ".join(f"{type(exc).__name__}: {exc}".split())
            self.scheduler.fail_all(exc)
        else:
            self._step_error = None

    # ------------------------------------------------------------------ commands (loop thread)
    def _add(self, request: Sequence) -> None:
        self.scheduler.add(request)

    def _abort_one(self, rid: str) -> bool:
        return self.scheduler.abort(rid)

    def _pause(self, mode: PauseMode) -> list[GenerationResult]:
        self._paused = True
        if mode is PauseMode.RETRACT:
            self.scheduler.retract_all()
            return []
        if mode is PauseMode.IN_PLACE:
            return []
        return self.scheduler.abort_all()

    def _set_paused(self, paused: bool) -> None:
        self._paused = paused

    def _update_weights(
        self, state: Mapping[str, torch.Tensor], version: int | None, keep_kv: bool
    ) -> int:
        self.runner.load_weights(state)
        self.adapter_base.reset()  # full weights: the new base of later adapters
        if self.versions is not None:
            self.versions.clear()  # every kept adapter was relative to the old base
            for seq in self.scheduler.requests.values():
                seq.pinned_version = None
        new_version = self._weights_changed(version, keep_kv)
        self._base_version = new_version
        return new_version

    def _apply_adapter(self, adapter: Adapter, version: int | None, keep_kv: bool) -> int:
        if self.versions is not None:
            return self._keep_adapter(adapter, version)
        self.runner.load_adapter(self.adapter_base.merged_state(self.runner.model, adapter))
        return self._weights_changed(version, keep_kv)

    def _keep_adapter(self, adapter: Adapter, version: int | None) -> int:
        """K adapters at once: keep ``adapter`` as the new version; only requests whose
        version it pushed out of the K kept are retracted (to resume under the newest)."""
        new_version = self._weight_version + 1 if version is None else int(version)
        evicted = set(self.versions.add(new_version, adapter))
        stranded = [s for s in self.scheduler.requests.values() if s.pinned_version in evicted]
        for seq in stranded:
            seq.pinned_version = None
        self.scheduler.retract([s for s in stranded if s.row >= 0])
        self._stats["kept_version"] += sum(1 for s in self.scheduler.running)
        self._weight_version = new_version
        return new_version

    def _servable(self, version: int | None) -> bool:
        return version is not None and (version in self.versions or version == self._base_version)

    def _route(self, seqs: list[Sequence]) -> None:
        """K adapters at once: pin each request without a servable version to the newest,
        and tell the adapters which version each row of the next batch decodes under."""
        if self.versions is None:
            return
        for seq in seqs:
            if not self._servable(seq.pinned_version):
                seq.pinned_version = self._weight_version
        self.versions.route([s.pinned_version for s in seqs])

    def _weights_changed(self, version: int | None, keep_kv: bool) -> int:
        if keep_kv:
            self._stats["kept_kv"] += len(self.scheduler.running)
        else:
            self.scheduler.retract_all()
        self._weight_version = self._weight_version + 1 if version is None else int(version)
        return self._weight_version

    def _stats_now(self) -> dict[str, Any]:
        return {
            **self._stats,
            "num_requests": len(self.scheduler.requests),
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "paused": self._paused,
            "weight_version": self._weight_version,
            "kv_cache_bytes": self.cache.nbytes(),
            "kv_cache_peak_bytes": self.cache.peak_bytes,
            "kv_budget_tokens": self.kv_budget_tokens,
            "kv_bytes_per_token": self.runner.kv_bytes_per_token,
            # the process's peak resident memory (a server's: the engine is all it runs)
            "peak_rss_mb": peak_rss_mb(),
        }

    def _stop(self) -> None:
        self.scheduler.abort_all()
        self._shutdown = True

    # ------------------------------------------------------------------ one iteration
    def step(self) -> None:
        """One scheduler iteration: admit + prefill new requests, then decode all running."""
        admitted = self.scheduler.admit()
        if admitted:
            self._route(admitted)
            self._advance(admitted, self.runner.prefill(admitted, route=self._route))
        running = self.scheduler.running
        if running:
            self._route(running)
            self._advance(list(running), self.runner.decode(running))
        self._stats["peak_running"] = max(self._stats["peak_running"], len(running))
        if not self.scheduler.running:
            self.cache.free()  # idle: no KV held between bursts

    def _advance(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Sample one token per request, record it, finish the ones that stop."""
        tokens, logprobs, tops = self.runner.sample(seqs, logits)
        now = time.perf_counter()
        finished: list[tuple[Sequence, FinishReason, Any]] = []
        for seq, tok, lp, top in zip(seqs, tokens, logprobs, tops, strict=True):
            version = self._weight_version if seq.pinned_version is None else seq.pinned_version
            seq.append(tok, lp, version, now, top)
            reason, matched = stop_reason(seq, tok, self.tokenizer)
            if reason is not None:
                finished.append((seq, reason, matched))
        self._stats["generated_tokens"] += len(seqs)
        if finished:
            self.scheduler.release([seq for seq, _, _ in finished])
            for seq, reason, matched in finished:
                self.scheduler.finish(seq, reason, matched)
