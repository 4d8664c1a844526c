"""Held-out evaluation grades in worker threads (the training loop runs it off its event
loop); math-verify's timeouts use ``signal.alarm`` and refuse threads. A real model writes
non-numeric answers (the suite's tiny models never do), which reach math-verify: graded in
the thread they crashed the run at its end, then (once a raising grader scored 0) scored a
right answer 0. Off the main thread math-verify now runs without its alarm; through the
run's grading pool they are graded in a worker process's main thread."""

from __future__ import annotations

import concurrent.futures

from relayrl.eval.evaluate import in_process_grader, pool_grader
from relayrl.rewards.pool import GradingPool
from relayrl.tasks.base import Problem

HALF = Problem(
    id="half", prompt="What is 1/2 of 1?", answer="\\frac{1}{2}", grader="math", meta={"math": {}}
)
ITEMS = [
    (HALF, "The answer is $\\boxed{\\frac{1}{2}}$"),  # right, only math-verify can tell
    (HALF, "The answer is \\boxed{x^2 + \\sqrt{y}}"),  # wrong and non-numeric
    (HALF, "I am not sure."),  # no answer
]


def in_a_thread(fn, *args):
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        return executor.submit(fn, *args).result(timeout=120)


def test_math_verify_grades_in_a_worker_thread(capsys):
    verdicts = in_a_thread(in_process_grader, ITEMS)
    assert [v.reward for v in verdicts] == [1.0, 0.0, 0.0]
    assert "raised" not in capsys.readouterr().err  # graded, not a grader error scored 0


def test_the_pool_grades_any_answer_from_any_thread():
    with GradingPool(1, 30.0) as pool:
        verdicts = in_a_thread(pool_grader(pool), ITEMS)
    assert [v.reward for v in verdicts] == [1.0, 0.0, 0.0]
