"""The Trajectory record: one sampled completion (or multi-turn episode) and everything
training needs about it, every token with its origin (prompt, model, environment); and
:func:`check_staleness`, the one check of the staleness bound."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

ORIGIN_MODEL = 1  # sampled by the policy: behaviour logprob and version, trained
ORIGIN_ENV = 2  # written by the environment (tool output, user turn): prefilled, never trained


@dataclass
class Trajectory:
    """One completion of one prompt, as produced by the rollout servers.

    ``behav_logprobs[i]`` and ``versions[i]`` belong to ``completion_ids[i]``: the logprob
    under the behaviour policy that sampled the token (temperature-scaled, see
    docs/engine.md) and the weight version that produced it. An interrupted request can span
    several versions.

    A multi-turn episode keeps everything after the prompt in ``completion_ids``: model
    turns and the environment's observations between them, told apart by ``origins``
    (:data:`ORIGIN_MODEL` / :data:`ORIGIN_ENV` per completion token; empty means all model,
    the single-turn case). Environment tokens were prefilled, never sampled: their
    behaviour logprob is 0, their version that of the model token before them, and
    :attr:`model_mask` excludes them from the loss. The staleness of an episode is its
    oldest model token's. ``episode`` holds the episode's counters (turns, tool calls, ...).

    ``advantage`` is set when the controller hands the batch out (over its
    complete groups), before any selection, so dropping samples later never changes a
    group's statistics. ``token_advantages`` (one per completion token) replaces it in the
    loss when not empty: a per-token estimator (REINFORCE++) or on-policy distillation's
    per-token reward; ``advantage`` then holds their mean over the model tokens.
    ``teacher_logprobs`` (on-policy distillation) are the teacher's logprobs of the
    completion tokens given the prompt and the tokens before them.
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
    origins: list[int] = field(default_factory=list)
    episode: dict[str, float] = field(default_factory=dict)
    token_advantages: list[float] = field(default_factory=list)
    teacher_logprobs: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if len(self.behav_logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"trajectory {self.group_id}/{self.sample_index}: {n} completion tokens but "
                f"{len(self.behav_logprobs)} logprobs and {len(self.versions)} versions"
            )
        if self.teacher_logprobs and len(self.teacher_logprobs) != n:
            raise ValueError(
                f"trajectory {self.group_id}/{self.sample_index}: {n} completion tokens but "
                f"{len(self.teacher_logprobs)} teacher logprobs"
            )
        if self.token_advantages and len(self.token_advantages) != n:
            raise ValueError(
                f"trajectory {self.group_id}/{self.sample_index}: {n} completion tokens but "
                f"{len(self.token_advantages)} token advantages"
            )
        if self.origins and len(self.origins) != n:
            raise ValueError(
                f"trajectory {self.group_id}/{self.sample_index}: {n} completion tokens but "
                f"{len(self.origins)} origins"
            )

    @property
    def model_mask(self) -> list[bool]:
        """Per completion token: sampled by the model (trained) or not (environment)."""
        if not self.origins:
            return [True] * len(self.completion_ids)
        return [o == ORIGIN_MODEL for o in self.origins]

    @property
    def num_model_tokens(self) -> int:
        if not self.origins:
            return len(self.completion_ids)
        return sum(o == ORIGIN_MODEL for o in self.origins)

    def _model_versions(self) -> list[int]:
        if not self.origins:
            return self.versions
        return [v for v, o in zip(self.versions, self.origins, strict=True) if o == ORIGIN_MODEL]

    @property
    def oldest_version(self) -> int:
        """The behaviour version of the trajectory: its oldest model token's (or, with no
        model token, the submission's)."""
        versions = self._model_versions()
        return min(versions) if versions else self.submit_version

    @property
    def newest_version(self) -> int:
        versions = self._model_versions()
        return max(versions) if versions else self.submit_version

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


class StalenessError(ValueError):
    """A sample outside the staleness bound: ``worst`` versions behind the trainer's
    ``version`` with ``eta`` allowed (or negative: from a version not reached yet)."""

    def __init__(self, worst: int, version: int, eta: int) -> None:
        super().__init__(
            f"a sample of staleness {worst} at trainer version {version}, bound eta={eta}"
        )
        self.worst, self.version, self.eta = worst, version, eta


def check_staleness(trajs: Iterable[Trajectory], version: int, eta: int) -> list[int]:
    """The staleness of each trajectory when trained at ``version``: the one check of the
    bound (the trainer's, a resumed controller's, a replay's). Raises
    :class:`StalenessError` if one is above ``eta`` or negative."""
    stale = [t.staleness(version) for t in trajs]
    if stale and (max(stale) > eta or min(stale) < 0):
        worst = max(stale) if max(stale) > eta else min(stale)
        raise StalenessError(worst, version, eta)
    return stale
