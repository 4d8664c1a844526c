"""Grading pool: errors, timeouts and crashes give 0, are counted, and the pool keeps working."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time

import pytest

from relayrl.rewards.pool import GradingPool
from relayrl.tasks.base import Problem
from tests.rewards._graders import behave

P = Problem("p", "q", "42", "math")


def test_raise_hang_crash_are_counted_and_pool_recovers() -> None:
    with GradingPool(workers=2, timeout_s=2.0, grader=behave) as pool:
        results = pool.grade_batch([(P, "42"), (P, "raise"), (P, "hang"), (P, "crash"), (P, "41")])
        assert [r.reward for r in results] == [1.0, 0.0, 0.0, 0.0, 0.0]
        assert [r.status for r in results] == ["ok", "error", "timeout", "crash", "ok"]
        assert "grader bug" in results[1].detail
        # replaced workers grade again
        again = pool.grade_batch([(P, "42")] * 4)
        assert [r.reward for r in again] == [1.0] * 4
        stats = pool.stats()
    assert stats["error"] == 1 and stats["timeout"] == 1 and stats["crash"] == 1
    assert stats["restarts"] == 2 and stats["graded"] == 9 and stats["ok"] == 6


def test_async_api() -> None:
    async def main(pool: GradingPool) -> list[float]:
        one = await pool.score(P, "42")
        many = await pool.score_batch([(P, "42"), (P, "7")])
        return [one.reward] + [r.reward for r in many]

    with GradingPool(workers=1, timeout_s=5.0, grader=behave) as pool:
        assert asyncio.run(main(pool)) == [1.0, 1.0, 0.0]


def test_score_batch_keeps_order_and_cancels_unstarted_items() -> None:
    """One wake-up per batch: results in input order with their statuses; cancelling the
    wait drops the items still queued (one worker, stuck on a hung item)."""

    async def main(pool: GradingPool):
        mixed = await pool.score_batch([(P, "raise"), (P, "42"), (P, "7")])
        assert await pool.score_batch([]) == []
        task = asyncio.create_task(pool.score_batch([(P, "hang")] + [(P, "42")] * 3))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return mixed

    with GradingPool(workers=1, timeout_s=1.0, grader=behave) as pool:
        mixed = asyncio.run(main(pool))
        deadline = time.monotonic() + 10
        while pool.stats()["timeout"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        stats = pool.stats()
    assert [r.status for r in mixed] == ["error", "ok", "ok"]
    assert [r.reward for r in mixed] == [0.0, 1.0, 0.0]
    assert stats["graded"] == 4 and stats["timeout"] == 1  # the 3 queued items never ran


def test_default_grader_routes_by_problem() -> None:
    synthetic = Problem("s", "q", "58", "math")  # no meta['math']: strict #### rule
    bench = Problem("b", "q", "\\frac{1}{2}", "math", {"math": {"modes": ["boxed"]}})
    with GradingPool(workers=1, timeout_s=30.0) as pool:
        results = pool.grade_batch(
            [(synthetic, "#### 58"), (synthetic, "58"), (bench, "so \\boxed{0.5}"), (bench, "0.5")]
        )
    assert [r.reward for r in results] == [1.0, 0.0, 1.0, 0.0]
    assert results[2].info["method"] == "math_verify"


def test_worker_killed_while_idle_is_replaced_without_costing_the_next_item() -> None:
    # the test process may hold other tests' children (pytest-xdist runs many in one process)
    others = set(multiprocessing.active_children())
    with GradingPool(workers=1, timeout_s=5.0, grader=behave) as pool:
        assert pool.grade_batch([(P, "42")])[0].status == "ok"
        (worker,) = set(multiprocessing.active_children()) - others
        os.kill(worker.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while worker.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        result = pool.grade_batch([(P, "42")])[0]
        assert (result.reward, result.status) == (1.0, "ok")
        stats = pool.stats()
    assert stats["restarts"] == 1 and stats["crash"] == 0 and stats["ok"] == 2
