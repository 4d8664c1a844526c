"""ReplayBuffer: eviction window, reuse limit, warm-up, checkpoint round trip."""

from __future__ import annotations

import json

import pytest

from relayrl.buffer.replay import ReplayBuffer
from relayrl.rollout.trajectory import Trajectory


def traj(group: str, idx: int, versions: list[int], submit: int | None = None) -> Trajectory:
    n = len(versions)
    return Trajectory(
        prompt_id=f"p-{group}",
        group_id=group,
        sample_index=idx,
        prompt_ids=[1, 2, 3],
        completion_ids=list(range(10, 10 + n)),
        behav_logprobs=[-0.5 - 0.1 * i for i in range(n)],
        versions=versions,
        submit_version=versions[0] if versions else (submit or 0),
        finish_reason="stop",
        reward=1.0,
        advantage=0.25,
        timings={"gen_s": 0.5},
    )


def keys(ts: list[Trajectory]) -> list[tuple[str, int]]:
    return [(t.group_id, t.sample_index) for t in ts]


def test_evict_keeps_last_k_versions_by_oldest_token() -> None:
    buf = ReplayBuffer(k=2, max_reuse=2)
    buf.add([traj("a", 0, [3, 3]), traj("b", 0, [4, 4]), traj("c", 0, [3, 5]), traj("d", 0, [5])])
    assert buf.version_counts() == {3: 2, 4: 1, 5: 1}
    gone = buf.evict(trainer_version=5)  # keep oldest_version >= 5 - 2 + 1 = 4
    assert sorted(keys(gone)) == [("a", 0), ("c", 0)]  # c spans 3..5: its oldest token is 3
    assert buf.version_counts() == {4: 1, 5: 1}
    assert len(buf) == 2
    assert buf.evict(5) == []


def test_k1_keeps_only_current_version() -> None:
    buf = ReplayBuffer(k=1, max_reuse=1)
    buf.add([traj("a", 0, [6]), traj("b", 0, [7])])
    buf.evict(7)
    assert keys(list(buf)) == [("b", 0)]


def test_candidates_respect_window_without_evict() -> None:
    buf = ReplayBuffer(k=2, max_reuse=3)
    buf.add([traj("old", 0, [1]), traj("new", 0, [3])])
    assert keys(buf.candidates(trainer_version=3, step=10)) == [("new", 0)]


def test_reuse_limit() -> None:
    buf = ReplayBuffer(k=4, max_reuse=2)
    a, b = traj("a", 0, [0]), traj("a", 1, [0])
    buf.add([a, b])
    buf.mark_trained([a])
    assert a.times_trained == 1
    assert keys(buf.candidates(0, step=0)) == [("a", 0), ("a", 1)]
    buf.mark_trained([a, b])
    assert a.times_trained == 2 and b.times_trained == 1
    assert keys(buf.candidates(0, step=0)) == [("a", 1)]
    assert len(buf) == 1  # exhausted samples leave the buffer
    with pytest.raises(KeyError):
        buf.mark_trained([a])


def test_max_reuse_one_means_each_sample_once() -> None:
    buf = ReplayBuffer(k=3, max_reuse=1)
    batch = [traj("g", i, [2]) for i in range(3)]
    buf.add(batch)
    buf.mark_trained(buf.candidates(2, step=5))
    assert buf.candidates(2, step=5) == [] and len(buf) == 0


def test_warmup_serves_only_fresh_samples() -> None:
    buf = ReplayBuffer(k=4, max_reuse=3, warmup=2)
    first = [traj("g0", 0, [0]), traj("g0", 1, [0])]
    buf.add(first)
    assert keys(buf.candidates(0, step=0)) == keys(first)
    buf.mark_trained(first)
    second = [traj("g1", 0, [1]), traj("g1", 1, [0, 1])]
    buf.add(second)
    # step 1 < warmup: only never-trained samples, whatever their version
    assert keys(buf.candidates(1, step=1)) == keys(second)
    # step 2 >= warmup: replay of trained samples (within reuse and window) joins
    assert keys(buf.candidates(1, step=2)) == keys(first + second)


def test_add_rejects_duplicates_and_exhausted() -> None:
    buf = ReplayBuffer(k=2, max_reuse=1)
    buf.add([traj("a", 0, [0])])
    with pytest.raises(ValueError):
        buf.add([traj("a", 0, [0])])
    with pytest.raises(ValueError):
        buf.add([traj("b", 0, [0]), traj("b", 0, [0])])
    used = traj("c", 0, [0])
    used.times_trained = 1
    with pytest.raises(ValueError):
        buf.add([used])
    assert len(buf) == 1


def test_invalid_settings() -> None:
    for kwargs in (
        {"k": 0, "max_reuse": 1},
        {"k": 1, "max_reuse": 0},
        {"k": 1, "max_reuse": 1, "warmup": -1},
    ):
        with pytest.raises(ValueError):
            ReplayBuffer(**kwargs)  # type: ignore[arg-type]


def test_state_dict_round_trip_through_json() -> None:
    buf = ReplayBuffer(k=3, max_reuse=3, warmup=1)
    items = [traj("a", 0, [4, 5]), traj("a", 1, [5]), traj("b", 0, [], submit=6)]
    buf.add(items)
    buf.mark_trained([items[1]])
    state = json.loads(json.dumps(buf.state_dict()))

    restored = ReplayBuffer(k=3, max_reuse=3, warmup=1)
    restored.load_state_dict(state)
    assert [t.to_dict() for t in restored] == [t.to_dict() for t in buf]
    assert restored.version_counts() == buf.version_counts() == {4: 1, 5: 1, 6: 1}
    assert keys(restored.candidates(6, step=0)) == [("a", 0), ("b", 0)]
    assert restored.state_dict() == buf.state_dict()
    assert restored.stats()["buffer/fresh"] == 2.0


def test_load_state_dict_applies_current_reuse_limit() -> None:
    buf = ReplayBuffer(k=3, max_reuse=3)
    a = traj("a", 0, [0])
    buf.add([a, traj("b", 0, [0])])
    buf.mark_trained([a])
    smaller = ReplayBuffer(k=3, max_reuse=1)
    smaller.load_state_dict(buf.state_dict())
    assert keys(list(smaller)) == [("b", 0)]
