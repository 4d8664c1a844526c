"""A process pool that grades (problem, completion) pairs with per-item timeouts.

Each worker is a *spawned* process (never forked from a parent that may hold torch threads)
that grades one item at a time on its main thread, where math-verify's ``signal.alarm``
works. One feeder thread per worker sends it items and waits for the answer up to
``timeout_s``:

* the grader raised → reward 0, status ``error`` (counted; the first error is printed to
  stderr once per pool), the worker keeps going;
* the problem names a grader the worker does not know (registered only in the parent, e.g.
  under ``if __name__ == "__main__"`` rather than in a plugin), or the worker cannot import
  the plugins → the item's future raises that :class:`~relayrl.errors.RelayError`: a
  configuration error, never a silent 0;
* no answer in time → the worker is killed and replaced, reward 0, status ``timeout``;
* the worker died (``os._exit``, segfault, OOM kill) → replaced, reward 0, status ``crash``;
* the worker died while idle (e.g. killed from outside between two items) → replaced
  before the next item is sent, which is graded normally (counted in ``restarts`` only).

The sandbox fails loudly, never as rewards that are all 0: ``probe_sandbox=True`` probes it
(a known-good and a known-bad candidate) when the pool starts, and a batch whose every
sample came back ``candidate_died`` (or the pool's first such sample) probes it again; a
failed probe raises :class:`relayrl.rewards.sandbox.SandboxUnavailable` (one ``error:``
line) from the batch call. A grader raising an exception marked ``fatal`` does the same.

APIs: :meth:`GradingPool.grade_batch` (blocking, results in input order),
:meth:`GradingPool.submit` (a ``concurrent.futures.Future``), and the asyncio-friendly
:meth:`GradingPool.score` / :meth:`GradingPool.score_batch` for the RL loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from relayrl.errors import RelayError
from relayrl.tasks.base import Problem

Grader = Callable[[Problem, str], Any]
STATUSES = ("ok", "error", "timeout", "crash", "fatal")


@dataclass(frozen=True)
class RewardResult:
    """A reward and how it was obtained; ``info`` holds grader details (e.g. extracted)."""

    reward: float
    status: str = "ok"
    detail: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


async def _all_done(futures: Sequence[Future]) -> None:
    """Wait for every concurrent future, woken once, by the last to finish; cancelling the
    wait cancels those not yet started.

    A cancelled wait is abandoned: the futures a worker was already grading finish later,
    possibly after the event loop closed (a run's end cancels the groups still grading),
    and their callback then leaves the loop alone (waking a closed loop raised "Event loop
    is closed" in a feeder thread)."""
    loop = asyncio.get_running_loop()
    all_done = loop.create_future()
    remaining = len(futures)
    lock = threading.Lock()
    abandoned = False

    def wake() -> None:
        if not all_done.done():
            all_done.set_result(None)

    def one_done(_: Future) -> None:
        nonlocal remaining
        with lock:
            remaining -= 1
            last = remaining == 0 and not abandoned
        if last:
            with contextlib.suppress(RuntimeError):  # closed between the check and now
                loop.call_soon_threadsafe(wake)

    for future in futures:
        future.add_done_callback(one_done)
    try:
        await all_done
    except asyncio.CancelledError:
        with lock:
            abandoned = True
        for future in futures:
            future.cancel()
        raise


def _default_grader(problem: Problem, completion: str) -> tuple[float, dict[str, Any]]:
    from relayrl.rewards.dispatch import grade_detail

    return grade_detail(problem, completion)


def _worker_main(conn: Any, grader: Grader) -> None:
    """Worker loop: receive (problem, completion), send ("ok", reward, info), ("error", msg)
    or, for a configuration error (``fatal`` set on the exception), ("fatal", msg)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Ctrl-C reaches the whole process group: the parent stops its workers (closing their
    # pipes), so a worker ignores SIGINT rather than print a KeyboardInterrupt traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from relayrl.plugins import load_plugins_from_env

    try:
        load_plugins_from_env()  # the user's graders, registered as in the parent
    except Exception as exc:
        conn.send(("fatal", f"grading worker: {exc}"))
        return
    if "torch" in sys.modules:  # graders should not need torch; if one imports it, 1 thread
        sys.modules["torch"].set_num_threads(1)
    conn.send(("ready",))
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        problem, completion = job
        try:
            out = grader(problem, completion)
            reward, info = out if isinstance(out, tuple) else (out, {})
            conn.send(("ok", float(reward), dict(info)))
        except Exception as exc:
            kind = "fatal" if getattr(exc, "fatal", False) else "error"
            conn.send((kind, f"{type(exc).__name__}: {exc}"[:500]))


REPROBE_AFTER_S = 60.0


def _fatal(results: Sequence[RewardResult]) -> RewardResult | None:
    return next((r for r in results if r.status == "fatal"), None)


def _sandbox_suspect(results: Sequence[RewardResult], probed_at: float | None) -> bool:
    """Every sample of a batch of 2+ (or a first one) came back ``candidate_died`` and the
    sandbox was not probed in the last minute."""
    died = sum(r.info.get("status") == "candidate_died" for r in results)
    if died == 0 or (died < len(results) or len(results) < 2) and probed_at is not None:
        return False
    return probed_at is None or time.monotonic() - probed_at > REPROBE_AFTER_S


class _Worker:
    def __init__(self, ctx: Any, grader: Grader, start_timeout_s: float) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, grader), daemon=True)
        self.process.start()
        child.close()
        if not self.conn.poll(start_timeout_s):
            self.stop()
            raise RuntimeError(f"grading worker did not start within {start_timeout_s}s")
        reply = self.conn.recv()
        if reply[0] == "fatal":
            self.stop()
            raise RelayError(reply[1])

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.process.kill()
        self.process.join(5)
        self.conn.close()


class FirstGraderError:
    """The first error a grader raised, printed once on stderr (later ones are only counted):
    the grading pool's, and in-process evaluation's (``relayrl.eval.evaluate``). ``what``
    says what became of the answer."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.first: str | None = None
        self._lock = threading.Lock()

    def report(self, problem: Problem, detail: str) -> None:
        with self._lock:
            if self.first is not None:
                return
            self.first = f"problem {problem.id!r} (grader {problem.grader!r}): {detail}"
        print(
            f"warning: a grader raised and {self.what} (only the first is printed): {self.first}",
            file=sys.stderr,
            flush=True,
        )


class GradingPool:
    """``workers`` grading processes; see the module docstring for the failure semantics."""

    def __init__(
        self,
        workers: int = 2,
        timeout_s: float = 30.0,
        grader: Grader | None = None,
        start_timeout_s: float = 120.0,
        probe_sandbox: bool = False,
    ) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self._probed_at: float | None = None
        if probe_sandbox:
            self._probe_sandbox()
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._grader = grader or _default_grader
        self.verifies = grader is None  # grades by the problems' own verifiers
        self._ctx = multiprocessing.get_context("spawn")
        self._jobs: queue.Queue[tuple[Future, Problem, str] | None] = queue.Queue()
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        self.first_error = FirstGraderError("scored 0, counted as status 'error'")
        self._closed = False
        self._threads = [
            threading.Thread(target=self._feed, name=f"grader-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    # -- public API -------------------------------------------------------------------------

    def submit(self, problem: Problem, completion: str) -> Future:
        """Queue one item; the future resolves to a :class:`RewardResult` (never raises)."""
        if self._closed:
            raise RuntimeError("grading pool is closed")
        future: Future = Future()
        self._jobs.put((future, problem, completion))
        return future

    def grade_batch(self, items: Sequence[tuple[Problem, str]]) -> list[RewardResult]:
        """Grade all items in parallel; results in input order."""
        futures = [self.submit(p, c) for p, c in items]
        results = [f.result() for f in futures]
        self._check_sandbox(results)
        return results

    async def score(self, problem: Problem, completion: str) -> RewardResult:
        """Asyncio-friendly single grade (does not block the event loop)."""
        return await asyncio.wrap_future(self.submit(problem, completion))

    async def score_batch(self, items: Sequence[tuple[Problem, str]]) -> list[RewardResult]:
        """Asyncio-friendly grades of ``items`` in input order, with one event-loop wake-up
        for the whole batch rather than one per item (the loop shares the trainer's GIL)."""
        futures = [self.submit(p, c) for p, c in items]
        if futures:
            await _all_done(futures)
        results = [f.result() for f in futures]
        if _sandbox_suspect(results, self._probed_at) or _fatal(results):
            await asyncio.to_thread(self._check_sandbox, results)
        return results

    def stats(self) -> dict[str, int]:
        """Counts: graded, ok, error, timeout, crash, restarts."""
        with self._lock:
            return {key: self.counters.get(key, 0) for key in ("graded", *STATUSES, "restarts")}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join()

    def __enter__(self) -> GradingPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the sandbox check -----------------------------------------------------------------

    def _probe_sandbox(self) -> None:
        from relayrl.rewards.code import probe_code_grading

        probe_code_grading()
        self._probed_at = time.monotonic()

    def _check_sandbox(self, results: Sequence[RewardResult]) -> None:
        """Raise if a grader reported a fatal error, or re-probe the sandbox when the
        batch looks like a broken one (see the module docstring)."""
        fatal = _fatal(results)
        if fatal is not None:
            from relayrl.rewards.sandbox import SandboxUnavailable

            raise SandboxUnavailable(fatal.detail)
        if _sandbox_suspect(results, self._probed_at):
            self._probe_sandbox()

    # -- feeder threads ---------------------------------------------------------------------

    def _count(self, *keys: str) -> None:
        with self._lock:
            for key in keys:
                self.counters[key] += 1

    def _feed(self) -> None:
        worker: _Worker | None = None
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                future, problem, completion = job
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    worker, result = self._grade_one(worker, problem, completion)
                except RelayError as exc:  # a configuration error: the caller must see it
                    future.set_exception(exc)
                    continue
                self._count("graded", result.status)
                if result.status == "error":
                    self.first_error.report(problem, result.detail)
                future.set_result(result)
        finally:
            if worker is not None:
                with contextlib.suppress(Exception):
                    worker.conn.send(None)
                worker.stop()

    def _grade_one(
        self, worker: _Worker | None, problem: Problem, completion: str
    ) -> tuple[_Worker | None, RewardResult]:
        start = time.monotonic()
        if worker is not None and not worker.process.is_alive():
            self._replace(worker)  # died while idle: not this item's fault
            worker = None
        try:
            if worker is None:
                worker = _Worker(self._ctx, self._grader, self.start_timeout_s)
            worker.conn.send((problem, completion))
            if not worker.conn.poll(self.timeout_s):
                self._replace(worker)
                return None, RewardResult(
                    0.0,
                    "timeout",
                    f"no result in {self.timeout_s}s",
                    seconds=time.monotonic() - start,
                )
            reply = worker.conn.recv()
        except (EOFError, OSError, RuntimeError) as exc:
            if worker is not None:
                self._replace(worker)
            return None, RewardResult(
                0.0,
                "crash",
                f"grading worker died: {type(exc).__name__}",
                seconds=time.monotonic() - start,
            )
        elapsed = time.monotonic() - start
        if reply[0] == "fatal":
            raise RelayError(reply[1])
        if reply[0] == "ok":
            return worker, RewardResult(reply[1], "ok", info=reply[2], seconds=elapsed)
        return worker, RewardResult(0.0, reply[0], reply[1], seconds=elapsed)

    def _replace(self, worker: _Worker) -> None:
        worker.stop()
        self._count("restarts")
        from relayrl.rewards.sandbox import kill_orphaned_sandboxes

        kill_orphaned_sandboxes()
