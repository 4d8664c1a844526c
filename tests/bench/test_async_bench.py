"""``relayrl bench async``'s overlap limit against hand-computed pipeline times."""

from __future__ import annotations

import pytest

from relayrl.bench.async_rl import overlap_limit


def test_overlap_limit_counts_the_pipeline_fill():
    # generation 1 s, training 2 s, 3 steps: one after the other 9 s; a perfect pipeline
    # generates batch 1 (1 s), then trains 1, 2, 3 (2 s each) while generating 2 and 3: 7 s
    assert overlap_limit(1.0, 2.0, 3) == pytest.approx(9 / 7)
    assert overlap_limit(2.0, 1.0, 3) == pytest.approx(9 / 7)  # symmetric: ends with a train
    assert overlap_limit(1.0, 2.0, None) == pytest.approx(1.5)
    assert overlap_limit(1.0, 1.0, 1) == pytest.approx(1.0)  # one step overlaps nothing
    assert overlap_limit(0.72, 1.0, 20) == pytest.approx(20 * 1.72 / (1.72 + 19))


def test_user_overrides_reach_both_sides_last(tmp_path):
    from relayrl.bench.async_rl import _overrides
    from relayrl.cli import build_parser

    args = build_parser().parse_args(
        ["bench", "async", "--quick", "train.publish_every=2", "rollout.concurrency=0"]
    )
    assert args.overrides == ["train.publish_every=2", "rollout.concurrency=0"]
    for eta in (0, 4):
        got = _overrides(args, tmp_path, tmp_path / "m", eta, {"server": 1, "trainer": 1}, "x")
        assert got[-2:] == ["train.publish_every=2", "rollout.concurrency=0"]
        assert f"rollout.eta={eta}" in got


def test_core_split_limit_uses_the_stage_times_at_the_split_thread_counts():
    from relayrl.bench.async_rl import core_split_limit

    # sync at 2 threads: 0.6 + 0.5 s per step; at 1 thread generation 0.7 s, training 0.8 s:
    # overlapped on one core each, a step takes at least 0.8 s
    best = {"t_gen": 0.6, "t_train": 0.5}
    one = {"t_gen": 0.7, "t_train": 0.8}
    assert core_split_limit(best, one) == pytest.approx(1.1 / 0.8)
    assert core_split_limit(one, one) == pytest.approx(1.5 / 0.8)  # = steady overlap limit
    # a 2 + 6 split: generation from the 2-thread run (0.9 s), training from the 6-thread
    # run (0.3 s); the 2-thread run's training (1.0 s) does not enter
    two, six = {"t_gen": 0.9, "t_train": 1.0}, {"t_gen": 0.4, "t_train": 0.3}
    assert core_split_limit(best, two, six) == pytest.approx(1.1 / 0.9)


def test_async_threads_split_the_cores_and_join_the_sync_candidates():
    from relayrl.bench.async_rl import split_threads, sync_thread_candidates
    from relayrl.errors import RelayError

    assert split_threads(None, 2) == {"server": 1, "trainer": 1}
    assert split_threads(None, 16) == {"server": 8, "trainer": 8}
    assert split_threads(None, 3) == {"server": 1, "trainer": 2}
    assert split_threads(None, 1) == {"server": 1, "trainer": 1}
    assert split_threads("4,12", 16) == {"server": 4, "trainer": 12}
    for bad in ("8", "8,0", "a,b", "1,2,3", "-1,2"):
        with pytest.raises(RelayError, match="--async-threads.*SERVER,TRAINER"):
            split_threads(bad, 16)
    # 2 cores: the runs of before (1 and 2 threads); 16 cores: 1, 16 and the split's 8
    assert sync_thread_candidates(None, {"server": 1, "trainer": 1}, 2) == [1, 2]
    assert sync_thread_candidates(None, {"server": 8, "trainer": 8}, 16) == [1, 8, 16]
    assert sync_thread_candidates(2, {"server": 4, "trainer": 12}, 16) == [2, 4, 12]


def test_measure_reads_stage_times_and_generation_speed_from_the_logs(tmp_path):
    import json

    from relayrl.bench.async_rl import measure

    # three steps of a synchronous run: 40 completion tokens per step; the first step's wait
    # includes the servers' warm-up (9 s), the others wait 2 s and 3 s for their batch
    steps = [
        {"step": i, "train_tokens": 99, "elapsed_s": t, "time_wait_s": w, "time_prox_s": 0.5}
        | {"time_update_s": 1.0, "time_sync_s": 0.25, "staleness_mean": 0.0}
        for i, (t, w) in enumerate([(11.0, 9.0), (15.0, 2.0), (20.0, 3.0)])
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in steps) + "\n")
    samples = [{"completion_tokens": 10} for _ in range(12)]
    (tmp_path / "samples.jsonl").write_text("\n".join(json.dumps(r) for r in samples) + "\n")
    got = measure(tmp_path)
    assert got["tokens_per_s"] == pytest.approx(120 / 20.0)
    assert got["t_gen"] == pytest.approx(2.5)  # steps 2.. only
    assert got["t_train"] == pytest.approx(1.75)
    assert got["gen_tokens_per_s"] == pytest.approx(40 / 2.5)
