"""Dynamic micro-batching (AReaL Algorithm 1): first-fit-decreasing packing under a token
budget.

Owns: ``pack_micro_batches`` and, for the data-parallel trainer, ``split_over_ranks`` and
``rank_micro_batches`` (each rank's share of a step by tokens, then FFD per rank). The trainer collates a micro-batch right-padded to its
longest sequence, so by default a micro-batch costs ``rows × longest`` (``cost="padded"``):
the tokens the forward pass actually computes. AReaL counts the sum of the sequences'
lengths instead (``cost="packed"``), which is the cost of varlen kernels that need no
padding; under right padding that model let the demo's micro-batches carry 39 % padding
(docs/async.md, "Trainer step"). Because the policy loss is normalised by a global constant
for the whole step (``relayrl.algo.losses``), how sequences are grouped here never changes
the gradient, only memory and speed.

Imports: the standard library only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

Cost = Literal["padded", "packed"]


def pack_micro_batches(
    lengths: Sequence[int], max_tokens: int, cost: Cost = "padded"
) -> list[list[int]]:
    """Indices of ``lengths`` grouped into micro-batches that cost at most ``max_tokens``.

    Sequences are taken longest first (ties by index) and each goes into the first
    micro-batch, in creation order, that still has room; when none has, a new one is
    opened. A micro-batch's cost is ``len(batch) × its longest sequence`` (``padded``) or
    the sum of its lengths (``packed``). A sequence over the budget gets a micro-batch of
    its own. Every index appears exactly once, and the result depends only on the inputs.
    """
    if max_tokens <= 0:
        raise ValueError("max_tokens must be > 0")
    if any(n < 0 for n in lengths):
        raise ValueError("lengths must be >= 0")
    if cost not in ("padded", "packed"):
        raise ValueError(f"cost must be 'padded' or 'packed', got {cost!r}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    loads: list[int] = []  # packed: the sum of lengths; padded: the rows
    for i in order:
        n = lengths[i]
        for b, load in enumerate(loads):
            # decreasing order: a batch's first sequence is its longest
            fits = (load + 1) * lengths[batches[b][0]] if cost == "padded" else load + n
            if fits <= max_tokens:
                batches[b].append(i)
                loads[b] += 1 if cost == "padded" else n
                break
        else:
            batches.append([i])
            loads.append(1 if cost == "padded" else n)
    return batches


def split_over_ranks(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Indices of ``lengths`` dealt to ``world_size`` ranks so that their token sums are as
    even as greedy allows: longest first (ties by index), each to the rank with the fewest
    tokens so far (ties: the lowest rank). Each rank's list is in increasing index order;
    every index appears exactly once; the result depends only on the inputs."""
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    loads = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shares[rank].append(i)
        loads[rank] += lengths[i]
    return [sorted(s) for s in shares]


def rank_micro_batches(
    lengths: Sequence[int], world_size: int, max_tokens: int, cost: Cost = "padded"
) -> list[list[list[int]]]:
    """Per rank, its micro-batches (indices into ``lengths``): ``split_over_ranks`` then
    ``pack_micro_batches`` on each rank's share under ``max_tokens``."""
    plans = []
    for share in split_over_ranks(lengths, world_size):
        packed = pack_micro_batches([lengths[i] for i in share], max_tokens, cost)
        plans.append([[share[j] for j in batch] for batch in packed])
    return plans
