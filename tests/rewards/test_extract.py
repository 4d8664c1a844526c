"""Answer extraction rules and the strict synthetic-task grader."""

from __future__ import annotations

from relayrl.rewards.extract import (
    extract_answer,
    extract_answer_is,
    extract_boxed,
    extract_hash_answer,
    extract_last_number,
    parse_number,
)
from relayrl.rewards.math import MathGradeConfig, grade_math, grade_math_answer

ALL = ("boxed", "hash", "answer_is", "last_number")


def test_boxed_nested_and_last() -> None:
    assert extract_boxed(r"x \boxed{\frac{1}{\sqrt{2}}} done") == r"\frac{1}{\sqrt{2}}"
    assert extract_boxed(r"\boxed{1} then \fbox{2} then \boxed{ {3} }") == "{3}"
    assert extract_boxed(r"\boxed{\{1,2\}}") == r"\{1,2\}"
    assert extract_boxed(r"\boxed{unclosed {") is None
    assert extract_boxed("no box") is None


def test_hash_marker_rules() -> None:
    assert extract_hash_answer("work\n#### 12\nbye") == "12"
    assert extract_hash_answer("#### 12 #### 13") is None
    assert extract_answer("#### 12 #### 13", ALL) is None  # ambiguous ends the search
    assert extract_hash_answer("no answer line here") is None
    assert extract_hash_answer("####   \n") is None


def test_answer_is_and_prose() -> None:
    text = "First 3+4 is 7. Then we double it, so the answer is $14$.\nThanks."
    assert extract_answer_is(text) == "14"
    assert extract_answer(text, ("boxed", "hash", "answer_is")) is not None
    buried = "We had 5 apples, ate 2, and bought 10 more, leaving 13 apples in the basket."
    assert extract_answer(buried, ("boxed", "hash", "answer_is")) is None
    found = extract_answer(buried, ALL)
    assert found is not None and (found.text, found.mode) == ("13", "last_number")
    assert extract_last_number("costs 1,234.50 dollars.") == "1,234.50"


def test_unicode_digits_refused() -> None:
    assert parse_number("٥٨") is None
    assert parse_number("５８") is None
    assert extract_answer("#### ５８", ALL) is None
    assert extract_answer(r"\boxed{٥٨}", ALL) is None
    assert not grade_math("#### ５８", "58")
    assert not grade_math_answer(r"\boxed{５８}", "58").correct


def test_huge_numbers_are_refused_quickly() -> None:
    huge = "9" * 100_000
    assert parse_number(huge) is None
    assert not grade_math(f"#### {huge}", "9")
    assert not grade_math_answer(f"\\boxed{{{huge}}}", "9").correct
    assert parse_number("-1,234.50") == parse_number("-1234.5")


def test_synthetic_grader_stays_strict() -> None:
    assert grade_math("17+5=22\n#### 22", "22")
    assert not grade_math("the answer is 22", "22")  # only #### counts
    assert not grade_math(r"\boxed{22}", "22")
    assert not grade_math("#### 22 #### 22", "22")


def test_benchmark_grader_equivalence() -> None:
    cfg = MathGradeConfig(exact_match=False)
    assert grade_math_answer(r"so \boxed{\dfrac{1}{2}}", "0.5", cfg).correct
    assert grade_math_answer("The answer is 3/4.", r"\frac34", cfg).correct
    assert not grade_math_answer(r"\boxed{2}", r"\frac{1}{2}", cfg).correct
    verdict = grade_math_answer("no answer at all", "1", cfg)
    assert (verdict.correct, verdict.method) == (False, "no_answer")
    last = MathGradeConfig(modes=("boxed",), last_number=True)
    assert grade_math_answer("so it is 12 apples", "12", last).correct
    assert not grade_math_answer(
        "so it is 12 apples", "12", MathGradeConfig(modes=("boxed",))
    ).correct
