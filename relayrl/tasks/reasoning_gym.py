"""reasoning-gym's procedural datasets as a relayrl task: ``task.name=reasoning_gym``.

``task.params``: ``dataset`` (a reasoning-gym dataset name, e.g. ``chain_sum``), ``config``
(that dataset's own settings, passed to ``reasoning_gym.create_dataset``), ``dataset_seed``
and ``extract`` (how the grader finds the answer: ``[tag, hash]`` by default, i.e.
``<answer>…</answer>`` as reasoning-gym's system prompt asks, else ``#### N``;
``last_number`` for a model that answers in a sentence). A problem is the dataset's item at an index drawn from relayrl's seeded
stream; train and test are disjoint by question text, like every synthetic task
(:class:`~relayrl.tasks.base.SyntheticTask`). Its grader, ``reasoning_gym``
(:mod:`relayrl.rewards.dispatch`), rebuilds the item from ``(dataset, config, dataset_seed,
index)`` and scores the extracted answer with the dataset's own ``score_answer``.

Demonstrations for SFT: ``chain_sum`` gets a worked left-to-right chain (one wrong partial
sum when ``wrong``); every other dataset an answer-only line (``wrong``: another item's
answer). reasoning-gym is an optional dependency (``pip install 'relayrl[reasoning-gym]'``).

Imports: the standard library, relayrl.tasks.base and relayrl.errors (reasoning-gym on use).
"""

from __future__ import annotations

import difflib
import json
import random
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from relayrl.errors import RelayError
from relayrl.tasks.base import Problem, SyntheticTask

INDEX_SPACE = 2**31 - 1  # reasoning-gym items are a pure function of (seed + index)
_WRONG_DELTAS = (-10, -2, -1, 1, 2, 10)


def _reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise RelayError(
            "task.name=reasoning_gym needs the reasoning-gym package: "
            "pip install 'relayrl[reasoning-gym]'"
        ) from None
    return reasoning_gym


@lru_cache(maxsize=32)
def _open(dataset: str, config_json: str, seed: int) -> Any:
    reasoning_gym = _reasoning_gym()
    names = sorted(reasoning_gym.factory.DATASETS)
    if dataset not in names:
        close = difflib.get_close_matches(dataset, names, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(names)}"
        raise RelayError(f"task.params.dataset: unknown reasoning-gym dataset {dataset!r}{hint}")
    config = json.loads(config_json)
    try:
        return reasoning_gym.create_dataset(dataset, seed=seed, size=INDEX_SPACE, **config)
    except (TypeError, ValueError, AssertionError) as exc:
        raise RelayError(f"task.params.config for reasoning-gym {dataset!r}: {exc}") from None


def open_dataset(dataset: str, config: dict[str, Any], seed: int) -> Any:
    """reasoning-gym's ``dataset`` with ``config`` and ``seed`` (one per process and key)."""
    return _open(dataset, json.dumps(config, sort_keys=True), seed)


def dataset_of(problem: Problem) -> Any:
    """The reasoning-gym dataset ``problem`` was drawn from (its ``score_answer``)."""
    meta = problem.meta
    return open_dataset(meta["dataset"], meta["config"], meta["dataset_seed"])


def item_of(problem: Problem) -> dict[str, Any]:
    """The reasoning-gym item ``problem`` was made from (what its scorer needs)."""
    return dataset_of(problem)[problem.meta["index"]]


@dataclass
class ReasoningGymTask(SyntheticTask):
    dataset: str = "chain_sum"
    config: dict[str, Any] = field(default_factory=dict)
    dataset_seed: int = 0
    test_fraction: float = 0.1
    # how the grader finds the answer in a completion (relayrl.rewards.extract's rules, the
    # first that finds one); None: <answer>…</answer>, else after ####
    extract: list[str] | None = None
    name: str = "reasoning_gym"

    def __post_init__(self) -> None:
        if self.extract is not None and (
            not isinstance(self.extract, list)
            or not self.extract
            or not all(isinstance(m, str) for m in self.extract)
        ):
            raise RelayError(
                f"task.params.extract: {self.extract!r}; expected a non-empty list of rule "
                "names (tag, hash, boxed, answer_is, last_number)"
            )
        self._data = open_dataset(self.dataset, self.config, self.dataset_seed)

    def _sample(self, rng: random.Random, problem_id: str) -> tuple[str, Problem]:
        index = rng.randrange(INDEX_SPACE)
        item = self._data[index]
        meta = {
            "dataset": self.dataset,
            "config": self.config,
            "dataset_seed": self.dataset_seed,
            "index": index,
            **({"extract": list(self.extract)} if self.extract else {}),
        }
        problem = Problem(problem_id, item["question"], str(item["answer"]), "reasoning_gym", meta)
        return item["question"], problem

    def demonstration(self, problem: Problem, rng: random.Random, wrong: bool = False) -> str:
        if self.dataset == "chain_sum":
            return _chain_sum_demonstration(item_of(problem), rng, wrong)
        answer = problem.answer
        if wrong:  # another item's answer: plausible in form, (almost always) wrong
            other = self._data[rng.randrange(INDEX_SPACE)]["answer"]
            answer = str(other) if str(other) != answer else answer + "0"
        return f"#### {answer}"


def _chain_sum_demonstration(item: dict[str, Any], rng: random.Random, wrong: bool) -> str:
    """``4 - 1 = 3`` / ``3 - 7 = -4`` / ``#### -4``: the expression's terms left to right."""
    tokens = item["metadata"]["expression"].split()
    value, lines = int(tokens[0]), []
    steps = list(zip(tokens[1::2], tokens[2::2], strict=True))
    bad_step = rng.randrange(len(steps)) if wrong and steps else -1
    for i, (op, term) in enumerate(steps):
        result = value + int(term) if op == "+" else value - int(term)
        if i == bad_step:
            result += rng.choice(_WRONG_DELTAS)
        lines.append(f"{value} {op} {term} = {result}")
        value = result
    lines.append(f"#### {value}")
    return "\n".join(lines)
