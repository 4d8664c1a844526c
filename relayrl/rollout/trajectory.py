"""The Trajectory record: one sampled completion and everything training needs about it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Trajectory:
    """One completion of one prompt, as produced by the rollout servers.

    ``behav_logprobs[i]`` and ``versions[i]`` belong to ``completion_ids[i]``: the logprob
    under the behaviour policy that sampled the token (temperature-scaled, see
    docs/engine.md) and the weight version that produced it. An interrupted request can span
    several versions. ``advantage`` is set when the controller hands the batch out (over its
    complete groups), before any selection, so dropping samples later never changes a
    group's statistics.
    """

    prompt_id: str
    group_id: str
    sample_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    behav_logprobs: list[float]
    versions: list[int]
    submit_version: int
    finish_reason: str = ""
    reward: float = 0.0
    reward_status: str = "ok"
    advantage: float = 0.0
    times_trained: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if len(self.behav_logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"trajectory {self.group_id}/{self.sample_index}: {n} completion tokens but "
                f"{len(self.behav_logprobs)} logprobs and {len(self.versions)} versions"
            )

    @property
    def oldest_version(self) -> int:
        """The behaviour version of the trajectory: its oldest token's (or submission's)."""
        return min(self.versions) if self.versions else self.submit_version

    @property
    def newest_version(self) -> int:
        return max(self.versions) if self.versions else self.submit_version

    def staleness(self, trainer_version: int) -> int:
        return trainer_version - self.oldest_version

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        return cls(**data)
