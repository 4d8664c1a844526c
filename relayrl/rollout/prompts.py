"""The order in which a run draws its training prompts.

Owns :class:`PromptLoader`: an endless, seeded, resumable stream over the train split.

Imports: relayrl.tasks.base, relayrl.errors.
"""

from __future__ import annotations

import random

from relayrl.errors import RelayError
from relayrl.tasks.base import Problem


class PromptLoader:
    """An endless, seeded stream over ``problems``: a fresh shuffle per epoch.

    ``draws`` counts prompts handed out (the prompt index of :func:`request_seed`); the
    state is (epoch, position, draws), so a run can resume where it stopped.
    """

    def __init__(self, problems: list[Problem], seed: int, shuffle: bool = True) -> None:
        if not problems:
            raise RelayError("the train split has no prompts")
        self.problems = problems
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self.draws = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.problems)))
        if self.shuffle:
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order

    def next(self) -> tuple[int, Problem]:
        """(prompt index, problem)."""
        if self.position >= len(self._order):
            self.epoch += 1
            self.position = 0
            self._order = self._epoch_order(self.epoch)
        problem = self.problems[self._order[self.position]]
        self.position += 1
        self.draws += 1
        return self.draws - 1, problem

    def problem_at(self, draw: int) -> Problem:
        """The problem handed out by draw number ``draw`` (the order is a function of the
        seed, so a checkpoint can store prompt indices instead of problems)."""
        epoch, position = divmod(draw, len(self.problems))
        order = self._order if epoch == self.epoch else self._epoch_order(epoch)
        return self.problems[order[position]]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "draws": self.draws}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position, self.draws = state["epoch"], state["position"], state["draws"]
        self._order = self._epoch_order(self.epoch)
