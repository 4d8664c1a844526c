"""Every gold answer, written as a completion in the dataset's format, grades correct; and
perturbed answers grade wrong. Runs through the grading pool (2 workers) as training does.

MATH/AIME golds are judged with ``exact_match=False`` so that math-verify itself (not the
exact-text shortcut) must accept each gold: anything it cannot grade is listed below and
in docs/graders.md.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from relayrl.rewards.extract import parse_number
from relayrl.rewards.pool import GradingPool
from relayrl.tasks.base import Problem
from relayrl.tasks.datasets import load_problems
from tests.conftest import FIXTURE_DATA, rows_in

# Gold answers math-verify cannot confirm against themselves (see docs/graders.md): none today.
EXPECTED_FAILURES: dict[str, set[str]] = {"math500": set(), "aime24": set(), "aime25": set()}


@pytest.fixture(scope="module")
def pool():
    with GradingPool(workers=2, timeout_s=60.0) as pool:
        yield pool


def _no_shortcut(problem: Problem) -> Problem:
    meta = dict(problem.meta)
    meta["math"] = {**meta["math"], "exact_match": False}
    return dataclasses.replace(problem, meta=meta)


def test_gsm8k_solutions_grade_correct(benchmark_data: Path, pool: GradingPool) -> None:
    import json

    solutions = {}
    for line in (benchmark_data / "gsm8k" / "test.jsonl").open():
        row = json.loads(line)
        solutions[row["id"]] = row["solution"]
    problems = load_problems("gsm8k", data_root=benchmark_data)
    results = pool.grade_batch([(p, solutions[p.id]) for p in problems])
    wrong = [p.id for p, r in zip(problems, results, strict=True) if r.reward != 1.0]
    assert len(problems) == rows_in(benchmark_data, "gsm8k/test.jsonl") and wrong == []


@pytest.mark.parametrize("name", ["math500", "aime24", "aime25"])
def test_boxed_golds_grade_correct(name: str, benchmark_data: Path, pool: GradingPool) -> None:
    problems = [_no_shortcut(p) for p in load_problems(name, data_root=benchmark_data)]
    items = [
        (p, f"Some reasoning.\nSo the final answer is $\\boxed{{{p.answer}}}$.") for p in problems
    ]
    results = pool.grade_batch(items)
    failed = {p.id for p, r in zip(problems, results, strict=True) if r.reward != 1.0}
    assert failed == EXPECTED_FAILURES[name]
    assert all(r.status == "ok" for r in results)


def perturbations(gold: str) -> list[str]:
    """Wrong versions of a gold answer: off by one, wrong sign, wrong fraction, digit swap."""
    out = []
    number = parse_number(gold)
    if number is not None:
        out.append(str(number + 1))
        if number != 0:
            out.append(str(-number))
    frac = re.search(r"\\[dt]?frac\{(\d+)\}\{(\d+)\}", gold)
    if frac:
        out.append(gold[: frac.start(1)] + str(int(frac.group(1)) + 1) + gold[frac.end(1) :])
    elif number is None:
        digit = re.search(r"\d", gold)
        if digit:
            swapped = str((int(digit.group()) + 1) % 10)
            out.append(gold[: digit.start()] + swapped + gold[digit.end() :])
    return out


def test_perturbed_answers_grade_wrong(benchmark_data: Path, pool: GradingPool) -> None:
    items = []
    for name in ("math500", "aime24", "aime25", "gsm8k"):
        problems = load_problems(name, data_root=benchmark_data)
        if name == "gsm8k":
            problems = problems[:300]
        for p in problems:
            fmt = "#### {}" if name == "gsm8k" else "so the answer is $\\boxed{{{}}}$."
            items += [(p, "Reasoning...\n" + fmt.format(bad)) for bad in perturbations(p.answer)]
            items.append((p, "I could not finish the computation."))  # answer missing
    results = pool.grade_batch(items)
    accepted = [(p.id, c[-60:]) for (p, c), r in zip(items, results, strict=True) if r.reward != 0]
    assert len(items) > (300 if benchmark_data == FIXTURE_DATA else 2000)
    assert len(accepted) <= 0.01 * len(items), accepted[:20]
