"""The grading pool at a run's end and on Ctrl-C: a batch still grading when the event loop
closes leaves no "Event loop is closed" behind, and a worker that gets the terminal's
SIGINT keeps grading, silently (issue 44 item 4)."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import time

from relayrl.rewards.pool import GradingPool
from relayrl.tasks.base import Problem


def slow_grader(problem: Problem, completion: str) -> float:
    time.sleep(float(completion))
    return 1.0


PROBLEM = Problem("p", "x", "1", "math")


def test_a_batch_abandoned_with_its_event_loop_wakes_no_closed_loop(caplog):
    """A run's end cancels the groups still grading and closes its loop; the grades in
    flight finish later, in the pool's threads, and must not wake the closed loop."""

    async def cancelled_batch(pool: GradingPool) -> None:
        task = asyncio.ensure_future(pool.score_batch([(PROBLEM, "1.0"), (PROBLEM, "1.0")]))
        await asyncio.sleep(0.3)
        task.cancel()

    pool = GradingPool(workers=2, timeout_s=30, grader=slow_grader)
    try:
        pool.grade_batch([(PROBLEM, "0"), (PROBLEM, "0")])  # both workers up
        with caplog.at_level(logging.ERROR, logger="concurrent.futures"):
            asyncio.run(cancelled_batch(pool))  # the loop is closed here, grades in flight
            time.sleep(1.5)  # they finish now
        assert "Event loop is closed" not in caplog.text, caplog.text
        assert [r.status for r in pool.grade_batch([(PROBLEM, "0")])] == ["ok"]
    finally:
        pool.close()


def test_a_grading_worker_ignores_the_terminals_sigint(capfd):
    """Ctrl-C reaches every process of the terminal's group: the run stops its workers
    itself, so a worker neither dies nor prints a KeyboardInterrupt traceback."""
    # an earlier test in this process may still be ending processes of its own
    others = set(multiprocessing.active_children())
    pool = GradingPool(workers=1, timeout_s=30, grader=slow_grader)
    try:
        assert pool.grade_batch([(PROBLEM, "0")])[0].status == "ok"
        (worker,) = set(multiprocessing.active_children()) - others
        os.kill(worker.pid, signal.SIGINT)
        time.sleep(0.5)
        assert worker.is_alive()
        assert pool.grade_batch([(PROBLEM, "0")])[0].status == "ok"
        assert set(multiprocessing.active_children()) - others == {worker}  # not replaced
    finally:
        pool.close()
    err = capfd.readouterr().err
    assert "KeyboardInterrupt" not in err and "Traceback" not in err, err
