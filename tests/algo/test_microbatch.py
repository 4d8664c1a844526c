"""First-fit-decreasing micro-batch packing."""

from __future__ import annotations

import random

import pytest

from relayrl.algo.microbatch import pack_micro_batches


def test_ffd_hand_packed_example() -> None:
    # sorted: 8(i2) 7(i5) 5(i0) 4(i4) 3(i1) 2(i3); budget 10
    # 8 -> B0; 7 -> B1; 5 -> B2; 4 -> B2 (9); 3 -> B1 (10); 2 -> B0 (10)
    assert pack_micro_batches([5, 3, 8, 2, 4, 7], 10) == [[2, 3], [5, 1], [0, 4]]


def test_oversized_sequence_gets_its_own_micro_batch() -> None:
    assert pack_micro_batches([3, 12, 4], 10) == [[1], [2, 0]]
    assert pack_micro_batches([12, 11], 10) == [[0], [1]]


def test_ties_broken_by_index_and_empty_input() -> None:
    assert pack_micro_batches([4, 4, 4], 8) == [[0, 1], [2]]
    assert pack_micro_batches([], 8) == []


def test_budget_respected_partition_and_deterministic() -> None:
    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 30))]
        budget = rng.randint(10, 80)
        batches = pack_micro_batches(lengths, budget)
        assert batches == pack_micro_batches(list(lengths), budget)
        flat = sorted(i for b in batches for i in b)
        assert flat == list(range(len(lengths)))
        for b in batches:
            load = sum(lengths[i] for i in b)
            assert load <= budget or len(b) == 1
        # FFD: no two micro-batches could have been merged when both are under budget
        loads = sorted(sum(lengths[i] for i in b) for b in batches)
        if len(loads) >= 2:
            assert loads[0] + loads[1] > budget


def test_invalid_budget() -> None:
    with pytest.raises(ValueError):
        pack_micro_batches([1, 2], 0)
