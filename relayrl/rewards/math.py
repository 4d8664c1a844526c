"""Math grading: extract the final answer, then compare it with the gold answer.

Plain numbers are compared exactly (as fractions) without calling into sympy; anything else
goes through math-verify (added by the graders work, see docs/graders.md).
"""

from __future__ import annotations

from relayrl.rewards.extract import extract_hash_answer, parse_number


def grade_math(completion: str, gold: str) -> bool:
    """True when the completion's ``#### X`` answer equals ``gold``."""
    answer = extract_hash_answer(completion)
    if answer is None:
        return False
    predicted, expected = parse_number(answer), parse_number(gold)
    if predicted is not None and expected is not None:
        return predicted == expected
    return answer.strip() == gold.strip()
