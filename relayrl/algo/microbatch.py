"""Dynamic micro-batching (AReaL Algorithm 1): first-fit-decreasing packing under a token
budget.

Owns: ``pack_micro_batches``. The budget counts the tokens of packed (unpadded) sequences,
so a micro-batch costs the sum of its sequences' lengths. Because the policy loss is
normalised by a global constant for the whole step (``relayrl.algo.losses``), how sequences
are grouped here never changes the gradient, only memory and speed.

Imports: the standard library only.
"""

from __future__ import annotations

from collections.abc import Sequence


def pack_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into micro-batches of at most ``max_tokens`` tokens.

    Sequences are taken longest first (ties by index) and each goes into the first
    micro-batch, in creation order, that still has room; when none has, a new one is
    opened. A sequence longer than the budget gets a micro-batch of its own. Every index
    appears exactly once, and the result depends only on the inputs.
    """
    if max_tokens <= 0:
        raise ValueError("max_tokens must be > 0")
    if any(n < 0 for n in lengths):
        raise ValueError("lengths must be >= 0")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        n = lengths[i]
        for b, load in enumerate(loads):
            if load + n <= max_tokens:
                batches[b].append(i)
                loads[b] += n
                break
        else:
            batches.append([i])
            loads.append(n)
    return batches
