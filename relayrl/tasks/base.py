"""The Problem record and the synthetic-task interface shared by every problem source."""

from __future__ import annotations

import dataclasses
import hashlib
import random
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, ClassVar

from relayrl.errors import RelayError

SPLITS = ("train", "test")


@dataclass(frozen=True)
class Problem:
    """One verifiable problem.

    ``grader`` names the verifier in :mod:`relayrl.rewards` ("math", "exact", "countdown",
    "code"); ``answer`` is the gold answer as text; ``meta`` holds what the grader needs
    beyond it; :attr:`row` is the dataset row the problem was made from (every column).
    """

    id: str
    prompt: str
    answer: str
    grader: str
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def row(self) -> dict[str, Any]:
        """The whole dataset row (``meta['row']``) for graders that need its other columns;
        empty for a synthetic task's problems."""
        return self.meta.get("row") or {}


def stable_bucket(key: str, buckets: int = 1000) -> int:
    """A process-independent hash bucket (Python's ``hash`` is salted per process)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % buckets


class SyntheticTask(ABC):
    """A generator of verifiable problems with worked demonstrations.

    Splits are disjoint by construction: a problem's canonical key hashes into the test split
    for ``test_fraction`` of the key space and into train otherwise, so no key can be drawn by
    both. Generation is a pure function of ``(seed, split, n)``.
    """

    name: str = ""
    test_fraction: float = 0.1
    # Parameters the SFT demonstrations use over the task's defaults (``task.params`` and
    # ``sft.task_params`` override them): for a task whose rare cases need more demonstrations
    # than their share of the problems to be learned at all.
    demonstration_params: ClassVar[dict[str, Any]] = {}

    def problems(self, split: str, n: int, seed: int) -> list[Problem]:
        if split not in SPLITS:
            raise RelayError(f"unknown split {split!r}; expected one of {SPLITS}")
        key = _cache_key(self, split, seed)
        cached = _GENERATED.get(key) if key is not None else None
        if cached is None or len(cached) < n:
            cached = self._generate(split, n, seed)
            if key is not None:
                _remember(key, cached)
        return list(cached[:n])

    def _generate(self, split: str, n: int, seed: int) -> tuple[Problem, ...]:
        """The first ``n`` problems of the split. Each problem depends only on those before
        it, so the first k of n are the k asked alone: a longer list answers a shorter ask."""
        rng = random.Random(f"{self.name}/{seed}/{split}")
        threshold = int(self.test_fraction * 1000)
        seen: set[str] = set()
        out: list[Problem] = []
        attempts = 0
        while len(out) < n:
            attempts += 1
            if attempts > 200 * n + 10_000:
                raise RelayError(
                    f"task {self.name!r} could only generate {len(out)} distinct {split} "
                    f"problems of the {n} asked; widen its difficulty settings"
                )
            key, problem = self._sample(rng, f"{self.name}-{split}-{len(out)}")
            in_test = stable_bucket(key) < threshold
            if in_test != (split == "test") or key in seen:
                continue
            seen.add(key)
            out.append(problem)
        return tuple(out)

    @abstractmethod
    def _sample(self, rng: random.Random, problem_id: str) -> tuple[str, Problem]:
        """Draw one problem; returns its canonical key and the Problem."""

    @abstractmethod
    def demonstration(self, problem: Problem, rng: random.Random, wrong: bool = False) -> str:
        """A worked completion ending in a ``#### ...`` line; ``wrong`` plants one bad step."""

    def demonstration_segments(
        self, problem: Problem, rng: random.Random, wrong: bool = False
    ) -> list[tuple[str, bool]]:
        """The demonstration as (text, written by the model) segments: a multi-turn task
        marks its environment's observations False so SFT does not train on them."""
        return [(self.demonstration(problem, rng, wrong), True)]


# Generated splits, per process: a run asks for the same split several times (setup, SFT, the
# evaluation sets, a check), and the 20 000 default train problems take about half a second
# to draw. Only dataclass tasks are kept: their repr is their whole configuration. The key
# holds the class itself, not its name: two user modules may define a task of one name.
_Key = tuple[type, str, str, int]
_GENERATED: OrderedDict[_Key, tuple[Problem, ...]] = OrderedDict()
_GENERATED_KEEP = 8


def _cache_key(task: SyntheticTask, split: str, seed: int) -> _Key | None:
    if not dataclasses.is_dataclass(task):
        return None
    return (type(task), repr(task), split, seed)


def _remember(key: _Key, problems: tuple[Problem, ...]) -> None:
    _GENERATED[key] = problems
    _GENERATED.move_to_end(key)
    while len(_GENERATED) > _GENERATED_KEEP:
        _GENERATED.popitem(last=False)
