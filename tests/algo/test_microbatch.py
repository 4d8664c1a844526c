"""First-fit-decreasing micro-batch packing, by padded cost (rows × longest, the default)
and by packed cost (the sum of lengths, AReaL's)."""

from __future__ import annotations

import random

import pytest

from relayrl.algo.microbatch import pack_micro_batches


def test_ffd_packed_hand_example() -> None:
    # sorted: 8(i2) 7(i5) 5(i0) 4(i4) 3(i1) 2(i3); budget 10
    # 8 -> B0; 7 -> B1; 5 -> B2; 4 -> B2 (9); 3 -> B1 (10); 2 -> B0 (10)
    assert pack_micro_batches([5, 3, 8, 2, 4, 7], 10, "packed") == [[2, 3], [5, 1], [0, 4]]


def test_ffd_padded_hand_example() -> None:
    # sorted: 8(i2) 7(i5) 5(i0) 4(i4) 3(i1) 2(i3); budget 16, cost rows × longest
    # 8 -> B0 (1×8); 7 -> B0 (2×8 = 16); 5 -> B1 (3×8 > 16); 4 -> B1 (2×5); 3 -> B1 (3×5);
    # 2 -> B2 (B0 3×8, B1 4×5 = 20 > 16)
    assert pack_micro_batches([5, 3, 8, 2, 4, 7], 16) == [[2, 5], [0, 4, 1], [3]]
    # the packed model would have put 12 tokens of padding into B0 instead
    assert pack_micro_batches([8, 1, 1, 1], 11, "packed") == [[0, 1, 2, 3]]
    assert pack_micro_batches([8, 1, 1, 1], 11) == [[0], [1, 2, 3]]


def test_oversized_sequence_gets_its_own_micro_batch() -> None:
    for cost in ("padded", "packed"):
        assert pack_micro_batches([3, 12, 4], 10, cost) == [[1], [2, 0]]
        assert pack_micro_batches([12, 11], 10, cost) == [[0], [1]]


def test_ties_broken_by_index_and_empty_input() -> None:
    assert pack_micro_batches([4, 4, 4], 8) == [[0, 1], [2]]
    assert pack_micro_batches([], 8) == []


@pytest.mark.parametrize("cost", ["padded", "packed"])
def test_budget_respected_partition_and_deterministic(cost) -> None:
    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 30))]
        budget = rng.randint(10, 80)
        batches = pack_micro_batches(lengths, budget, cost)
        assert batches == pack_micro_batches(list(lengths), budget, cost)
        flat = sorted(i for b in batches for i in b)
        assert flat == list(range(len(lengths)))

        for b in batches:
            longest = max(lengths[i] for i in b)
            load = len(b) * longest if cost == "padded" else sum(lengths[i] for i in b)
            assert load <= budget or len(b) == 1
        # first fit: the sequence that opened each micro-batch fitted in no earlier one,
        # and earlier ones only filled up since
        for j, later in enumerate(batches):
            opener = lengths[later[0]]
            for b in batches[:j]:
                if cost == "padded":
                    assert (len(b) + 1) * max(lengths[i] for i in b) > budget
                else:
                    assert sum(lengths[i] for i in b) + opener > budget


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError):
        pack_micro_batches([1, 2], 0)
    with pytest.raises(ValueError):
        pack_micro_batches([1, 2], 4, "sideways")
