"""Dynamic micro-batching (AReaL Algorithm 1): first-fit-decreasing packing under a token
budget.

Owns: ``pack_micro_batches``. The trainer collates a micro-batch right-padded to its
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
