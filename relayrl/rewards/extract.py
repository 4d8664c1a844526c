"""Answer extraction from model completions.

Rules (documented in docs/graders.md):

* ``#### X`` (GSM8K convention): exactly one ``####`` marker in the completion; the answer is
  the rest of that line, stripped. Two markers (``#### 12 #### 13``) are ambiguous: no answer.
* Numbers are ASCII only: ``٥٨`` or fullwidth ``５８`` are not read as 58, because a verifier
  that normalises lookalike digits can be gamed and no dataset we grade writes them.
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = re.compile(r"[+-]?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?", re.ASCII)
# Longer numbers are refused rather than parsed: nothing we grade needs them and
# Fraction("9"*10**6) would let a completion burn seconds of CPU.
MAX_NUMBER_CHARS = 64


def extract_hash_answer(text: str) -> str | None:
    """The text after the single ``####`` marker, up to the end of its line."""
    if text.count("####") != 1:
        return None
    answer = text.split("####", 1)[1].split("\n", 1)[0].strip()
    return answer or None


def parse_number(text: str) -> Fraction | None:
    """An exact number from ``text`` such as ``-1,234.50`` (``$`` and a final ``.`` allowed)."""
    s = text.strip()
    s = s.removeprefix("$").removesuffix(".").strip()
    if len(s) > MAX_NUMBER_CHARS or not _NUMBER.fullmatch(s):
        return None
    return Fraction(s.replace(",", ""))
