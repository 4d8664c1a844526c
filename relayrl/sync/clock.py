"""The two versions of a live run's weights, read from one place.

Owns: :class:`VersionClock`. The trainer's version is the trainer's own count of updates
(read from it, never copied); the published version, the newest one every rollout server
serves, has exactly one writer, :class:`relayrl.sync.weight_sync.WeightSync`, which advances it when a
publication has ended (loaded, verified and, when due, passed the canary) and then tells the
rollout controller, whose admission bound moves up with it. The controller reads this same
clock (as its ``relayrl.rollout.controller.PublishedVersion``) and keeps no copy.

Imports: nothing of relayrl.
"""

from __future__ import annotations

from typing import Protocol


class Versioned(Protocol):
    """The trainer as the clock reads it: ``version`` counts its updates."""

    version: int


class VersionClock:
    """``trainer_version``: the version of the weights the trainer holds;
    ``published``: the newest version every server serves (0: the model directory they
    started from); ``lag``: how many versions the servers are behind the trainer."""

    def __init__(self, trainer: Versioned | None = None, published: int = 0) -> None:
        self._trainer = trainer
        self._published = published

    @property
    def published(self) -> int:
        return self._published

    @property
    def trainer_version(self) -> int:
        """The trainer's version; without a trainer (a publication of given weights, as
        the transport tests and benchmarks do) the published one."""
        return self._trainer.version if self._trainer is not None else self._published

    @property
    def lag(self) -> int:
        return self.trainer_version - self._published

    def advance(self, version: int) -> None:
        """Every server now serves ``version`` (its publisher's call; versions never go
        back, publications land in order)."""
        if version < self._published:
            raise ValueError(f"published version {version} is older than {self._published}")
        self._published = version

    def __repr__(self) -> str:
        return f"VersionClock(trainer={self.trainer_version}, published={self._published})"


__all__ = ["VersionClock", "Versioned"]
