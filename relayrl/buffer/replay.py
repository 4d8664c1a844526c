"""The D-ARL replay buffer: trajectories of the K most recent behaviour versions.

Owns: ``ReplayBuffer``. A trajectory's behaviour version is ``Trajectory.oldest_version``
(the oldest weight version among its tokens: an interrupted request spans two). The buffer
decides which stored trajectories are *candidates* for a training step; scoring and
selecting among them is ``relayrl.algo.darl``'s job, and the trainer reports back what it
trained on with ``mark_trained``.

How the trainer uses it (``relayrl.train.replay_step``): the fresh samples of a step come
from the rollout controller and are always trained once, whatever K (their staleness is
already bounded by η at admission); after the step they are added, marked trained, and
evicted once their version leaves the window. So in training the buffer holds exactly the
replay pool (trained fewer than ``max_reuse`` times, oldest version ≥ v − K + 1), and
warm-up means "no replay". K = 1 or ``max_reuse = 1`` therefore never replays anything and
the step is plain decoupled PPO.

The buffer itself also accepts never-trained ("fresh", ``times_trained == 0``) samples, and
during warm-up serves only those; fresh means "not trained yet" rather than a version test
because "version == trainer version" is often empty in fully asynchronous mode, "version ==
trainer version − 1" is wrong at η = 0 and "version == newest present" would skip admitted
samples of the previous version.

Imports: relayrl.rollout.trajectory and the standard library.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from relayrl.rollout.trajectory import Trajectory

Key = tuple[str, int]


def _key(traj: Trajectory) -> Key:
    return (traj.group_id, traj.sample_index)


class ReplayBuffer:
    """Trajectories keyed by ``(group_id, sample_index)``, in arrival order.

    - ``k``: number of behaviour versions kept: at trainer version ``v`` a trajectory stays
      while ``oldest_version ≥ v − k + 1`` (k = 1 keeps only the current version's).
    - ``max_reuse``: a trajectory is trained at most this many times (1 = no replay).
    - ``warmup``: during steps ``0 … warmup − 1`` only fresh (never trained) samples are
      candidates.
    """

    def __init__(self, k: int, max_reuse: int, warmup: int = 0) -> None:
        if k < 1:
            raise ValueError("k must be >= 1")
        if max_reuse < 1:
            raise ValueError("max_reuse must be >= 1")
        if warmup < 0:
            raise ValueError("warmup must be >= 0")
        self.k = k
        self.max_reuse = max_reuse
        self.warmup = warmup
        self._items: dict[Key, Trajectory] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Trajectory]:
        return iter(list(self._items.values()))

    def min_version(self, trainer_version: int) -> int:
        """The oldest behaviour version kept at ``trainer_version``: ``v − k + 1``."""
        return trainer_version - self.k + 1

    def add(self, trajs: Iterable[Trajectory]) -> None:
        """Store new trajectories; a key already stored is an error."""
        new = list(trajs)
        keys = [_key(t) for t in new]
        if len(set(keys)) != len(keys):
            raise ValueError("duplicate trajectories in one add()")
        for key, t in zip(keys, new, strict=True):
            if key in self._items:
                raise ValueError(f"trajectory {key} is already in the buffer")
            if t.times_trained >= self.max_reuse:
                raise ValueError(f"trajectory {key} was already trained max_reuse times")
        for key, t in zip(keys, new, strict=True):
            self._items[key] = t

    def evict(self, trainer_version: int) -> list[Trajectory]:
        """Drop trajectories with ``oldest_version < v − k + 1``; return them."""
        floor = self.min_version(trainer_version)
        gone = [key for key, t in self._items.items() if t.oldest_version < floor]
        return [self._items.pop(key) for key in gone]

    def candidates(self, trainer_version: int, step: int) -> list[Trajectory]:
        """Trajectories eligible for the step at ``trainer_version`` (the stored objects).

        Within the K-version window, trained fewer than ``max_reuse`` times; during warm-up
        (``step < warmup``) only fresh ones (``times_trained == 0``).
        """
        floor = self.min_version(trainer_version)
        fresh_only = step < self.warmup
        return [
            t
            for t in self._items.values()
            if t.oldest_version >= floor
            and t.times_trained < self.max_reuse
            and not (fresh_only and t.times_trained > 0)
        ]

    def mark_trained(self, trajs: Iterable[Trajectory]) -> None:
        """Count one more use of each stored trajectory; drop those that reach
        ``max_reuse``. An unknown trajectory is an error."""
        for t in trajs:
            key = _key(t)
            stored = self._items.get(key)
            if stored is None:
                raise KeyError(f"trajectory {key} is not in the buffer")
            stored.times_trained += 1
            if stored is not t:
                t.times_trained = stored.times_trained
            if stored.times_trained >= self.max_reuse:
                del self._items[key]

    def version_counts(self) -> dict[int, int]:
        """Number of stored trajectories per behaviour version, oldest first."""
        counts: dict[int, int] = {}
        for t in self._items.values():
            counts[t.oldest_version] = counts.get(t.oldest_version, 0) + 1
        return dict(sorted(counts.items()))

    def stats(self) -> dict[str, float]:
        """Flat metrics for logging: size, fresh count, per-version counts."""
        out: dict[str, float] = {
            "buffer/size": float(len(self._items)),
            "buffer/fresh": float(sum(t.times_trained == 0 for t in self._items.values())),
        }
        for v, n in self.version_counts().items():
            out[f"buffer/count/v{v}"] = float(n)
        return out

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable contents (arrival order kept) and settings."""
        return {
            "k": self.k,
            "max_reuse": self.max_reuse,
            "warmup": self.warmup,
            "trajectories": [t.to_dict() for t in self._items.values()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the contents with a saved state. The settings of this buffer (from the
        current config) win over the saved ones, so a resumed run may change K or reuse."""
        trajs = [Trajectory.from_dict(dict(d)) for d in state["trajectories"]]
        self._items = {}
        self.add(t for t in trajs if t.times_trained < self.max_reuse)
