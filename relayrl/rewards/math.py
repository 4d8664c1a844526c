"""Math grading: extract the final answer, then compare it with the gold answer.

Two entry points:

* :func:`grade_math` — the synthetic tasks' strict, fast rule: the single ``#### X`` line,
  compared as an exact number (or exact text). No sympy, no timeouts needed.
* :func:`grade_math_answer` — benchmarks (GSM8K, MATH, AIME): extraction rules and their
  order come from a :class:`MathGradeConfig` (per dataset); then an exact-number fast path,
  an optional exact-text match, and otherwise math-verify (``parse`` + ``verify``), the gold
  parsed with LaTeX and plain-expression extraction.

math-verify's own timeouts use ``signal.alarm``: call :func:`grade_math_answer` from a
process's main thread (the grading pool does), or pass ``timeout_s=None``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from relayrl.rewards.extract import extract_answer, extract_hash_answer, parse_number

MATH_VERIFY_MAX_CHARS = 400


def grade_math(completion: str, gold: str) -> bool:
    """True when the completion's ``#### X`` answer equals ``gold``."""
    answer = extract_hash_answer(completion)
    if answer is None:
        return False
    predicted, expected = parse_number(answer), parse_number(gold)
    if predicted is not None and expected is not None:
        return predicted == expected
    return answer.strip() == gold.strip()


@dataclass(frozen=True)
class MathGradeConfig:
    """How to read and compare a benchmark answer.

    ``modes``: extraction rules tried in order (see :mod:`relayrl.rewards.extract`);
    ``last_number``: append the last-number fallback; ``exact_match``: accept an answer whose
    text equals the gold after whitespace removal before calling math-verify;
    ``timeout_s``: math-verify's per-call limit (``None`` disables its ``signal.alarm``).
    """

    modes: tuple[str, ...] = ("boxed", "answer_is", "hash")
    last_number: bool = False
    exact_match: bool = True
    timeout_s: int | None = 5

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> MathGradeConfig:
        """The config a dataset stored in ``Problem.meta['math']`` (defaults otherwise)."""
        spec = dict(meta.get("math") or {})
        if "modes" in spec:
            spec["modes"] = tuple(spec["modes"])
        return cls(**spec)

    def all_modes(self) -> Sequence[str]:
        return (*self.modes, "last_number") if self.last_number else self.modes


@dataclass(frozen=True)
class MathVerdict:
    """Whether the answer is right, what was read, and which comparison decided it."""

    correct: bool
    extracted: str | None
    method: str  # "no_answer" | "number" | "exact" | "math_verify" | "unparsable"
    details: dict[str, Any] = field(default_factory=dict)


def _squash(text: str) -> str:
    return "".join(text.split())


def _latex_configs() -> list[Any]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return [LatexExtractionConfig(), ExprExtractionConfig()]


def math_verify_equal(answer: str, gold: str, timeout_s: int | None = 5) -> bool | None:
    """math-verify's judgement of ``answer`` against ``gold`` (both bare LaTeX/expressions).

    None when either side cannot be parsed. math-verify's timeout is ``signal.alarm``, which
    only the main thread may set (it raises elsewhere, and a correct non-numeric answer
    graded in a worker thread was a crash, then a silent 0); off the main thread it runs
    without one, as math-verify advises, on answers already capped at
    :data:`MATH_VERIFY_MAX_CHARS` characters (the grading pool's per-item deadline bounds
    it there).
    """
    from math_verify import parse, verify

    if threading.current_thread() is not threading.main_thread():
        timeout_s = None

    configs = _latex_configs()
    gold_parsed = parse(f"${gold}$", extraction_config=configs, parsing_timeout=timeout_s)
    pred_parsed = parse(
        f"$\\boxed{{{answer}}}$", extraction_config=configs, parsing_timeout=timeout_s
    )
    if not gold_parsed or not pred_parsed:
        return None
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout_s))


def grade_math_answer(
    completion: str, gold: str, config: MathGradeConfig | None = None
) -> MathVerdict:
    """Grade a benchmark completion against its gold answer (see the module docstring)."""
    config = config or MathGradeConfig()
    found = extract_answer(completion, config.all_modes())
    if found is None:
        return MathVerdict(False, None, "no_answer")
    answer = found.text
    predicted, expected = parse_number(answer), parse_number(gold)
    if predicted is not None and expected is not None:
        return MathVerdict(predicted == expected, answer, "number")
    if config.exact_match and _squash(answer) == _squash(gold):
        return MathVerdict(True, answer, "exact")
    if len(answer) > MATH_VERIFY_MAX_CHARS:
        return MathVerdict(False, answer, "unparsable", {"reason": "answer too long"})
    judged = math_verify_equal(answer, gold, config.timeout_s)
    if judged is None:
        return MathVerdict(False, answer, "unparsable")
    return MathVerdict(judged, answer, "math_verify")
