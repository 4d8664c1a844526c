"""The C heap of a long-running torch process: hand its free pages back to the OS.

PyTorch's CPU tensors come from ``malloc``. glibc raises its mmap threshold each time a
large block is freed, so later blocks of that size come from the heap, and memory freed
in the middle of the heap stays with the process. An RL step's tensors change shape with
every batch, so the freed memory fragments: SmolLM2-135M's trainer held 3.7, 6.2, 9.2 and
10.6 GB between its first four steps (peaks 6.3 → 13.7 GB) where about 2.5 GB were live.
``malloc_trim(0)`` returns the free pages of every arena; the trainer calls it after each
step (``relayrl.train.loop``), a built-in server after each weight load
(``relayrl.engine.engine``).

Imports: nothing of relayrl.
"""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): nothing to trim
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def release_free_heap() -> bool:
    """Return the C heap's free pages to the OS (glibc's ``malloc_trim(0)``); False where
    the C library has no such call."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
