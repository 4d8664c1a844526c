"""Answer extraction from model completions.

Rules (documented in docs/graders.md):

* ``\\boxed{X}`` / ``\\fbox{X}``: the **last** such command in the completion; braces nest
  (``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``). An unbalanced last box gives no answer.
* ``#### X`` (GSM8K convention): exactly one ``####`` marker in the completion; the answer is
  the rest of that line, stripped. Two markers (``#### 12 #### 13``) are ambiguous: no answer,
  and :func:`extract_answer` stops there instead of trying later rules.
* ``the answer is X``: the last occurrence (case-insensitive); the answer runs to the end of
  its line, without a final ``.`` and surrounding ``$``.
* last number: the last ASCII number in the text; a fallback that is off unless asked for.
* Numbers are ASCII only: ``٥٨`` or fullwidth ``５８`` are not read as 58, because a verifier
  that normalises lookalike digits can be gamed and no dataset we grade writes them. An
  extracted answer holding a non-ASCII digit is refused.
* Every extracted answer is at most ``MAX_ANSWER_CHARS`` long, and the completion is only
  scanned up to ``MAX_COMPLETION_CHARS``; longer inputs give no answer rather than slow work.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

_NUMBER = re.compile(r"[+-]?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?", re.ASCII)
_ANY_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?", re.ASCII)
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_IS = re.compile(r"(?:final\s+)?answer\s+is\s*:?", re.IGNORECASE)
# Longer numbers are refused rather than parsed: nothing we grade needs them and
# Fraction("9"*10**6) would let a completion burn seconds of CPU.
MAX_NUMBER_CHARS = 64
MAX_ANSWER_CHARS = 1000
MAX_COMPLETION_CHARS = 200_000

MODES = ("tag", "boxed", "hash", "answer_is", "last_number")


class _Ambiguous(Exception):
    """More than one answer marker: the completion has no answer."""


@dataclass(frozen=True)
class Extracted:
    """An extracted answer and the rule that found it."""

    text: str
    mode: str


def extract_hash_answer(text: str) -> str | None:
    """The text after the single ``####`` marker, up to the end of its line."""
    if text.count("####") != 1:
        return None
    answer = text.split("####", 1)[1].split("\n", 1)[0].strip()
    return answer or None


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` or ``\\fbox{...}``, braces balanced."""
    matches = list(_BOX.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    depth = 1
    for i in range(start, min(len(text), start + MAX_ANSWER_CHARS + 1)):
        ch = text[i]
        if ch == "{" and text[i - 1] != "\\":
            depth += 1
        elif ch == "}" and text[i - 1] != "\\":
            depth -= 1
            if depth == 0:
                return text[start:i].strip() or None
    return None


def extract_answer_is(text: str) -> str | None:
    """What follows the last "the answer is" up to the end of its line."""
    matches = list(_ANSWER_IS.finditer(text))
    if not matches:
        return None
    rest = text[matches[-1].end() :].split("\n", 1)[0].strip()
    rest = rest.rstrip(".").strip().strip("$").strip()
    return rest or None


def extract_last_number(text: str) -> str | None:
    """The last ASCII number in the text (``1,234.5`` kept whole)."""
    found = _ANY_NUMBER.findall(text)
    return found[-1].rstrip(",") if found else None


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_tagged_answer(text: str) -> str | None:
    """The text inside the last ``<answer>…</answer>`` (stripped), or None: the format
    reasoning-gym's system prompt asks for (``reasoning_gym.utils.SYSTEM_PROMPTS``)."""
    matches = _ANSWER_TAG.findall(text)
    return matches[-1].strip() if matches else None


def _hash_mode(text: str) -> str | None:
    count = text.count("####")
    if count > 1:
        raise _Ambiguous
    return extract_hash_answer(text) if count == 1 else None


_EXTRACTORS = {
    "tag": extract_tagged_answer,
    "boxed": extract_boxed,
    "hash": _hash_mode,
    "answer_is": extract_answer_is,
    "last_number": extract_last_number,
}


def has_foreign_digit(text: str) -> bool:
    """True when ``text`` holds a decimal digit outside ASCII 0-9 (e.g. Arabic-Indic, fullwidth)."""
    return any(not ch.isascii() and unicodedata.category(ch) == "Nd" for ch in text)


def extract_answer(text: str, modes: Sequence[str] = ("boxed", "hash")) -> Extracted | None:
    """The answer found by the first rule in ``modes`` that finds one, or None.

    An ambiguous ``####`` (two markers) ends the search with None. Answers that are too long or
    hold non-ASCII digits are refused (None).
    """
    unknown = [m for m in modes if m not in _EXTRACTORS]
    if unknown:
        raise ValueError(f"unknown extraction modes {unknown}; expected some of {MODES}")
    if len(text) > MAX_COMPLETION_CHARS:
        return None
    for mode in modes:
        try:
            answer = _EXTRACTORS[mode](text)
        except _Ambiguous:
            return None
        if answer is not None:
            if len(answer) > MAX_ANSWER_CHARS or has_foreign_digit(answer):
                return None
            return Extracted(answer, mode)
    return None


def parse_number(text: str) -> Fraction | None:
    """An exact number from ``text`` such as ``-1,234.50`` (``$`` and a final ``.`` allowed)."""
    s = text.strip()
    s = s.removeprefix("$").removesuffix(".").strip()
    if len(s) > MAX_NUMBER_CHARS or not _NUMBER.fullmatch(s):
        return None
    return Fraction(s.replace(",", ""))
