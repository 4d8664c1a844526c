"""The memory a long-running torch process keeps past its need: the C heap's free pages
and the bf16 kernel caches; and the peak a process reached (``peak_rss_mb``).

PyTorch's CPU tensors come from ``malloc``. glibc raises its mmap threshold each time a
large block is freed, so later blocks of that size come from the heap, and memory freed
in the middle of the heap stays with the process. An RL step's tensors change shape with
every batch, so the freed memory fragments: SmolLM2-135M's trainer held 3.7, 6.2, 9.2 and
10.6 GB between its first four steps (peaks 6.3 → 13.7 GB) where about 2.5 GB were live.
``malloc_trim(0)`` returns the free pages of every arena; the trainer calls it after each
step (``relayrl.train.loop``), a built-in server after each weight load
(``relayrl.engine.engine``).

In bfloat16 on a CPU, PyTorch runs each matrix product through oneDNN, which compiles a
primitive per shape and keeps it in two caches, oneDNN's own
(``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and ideep's (``LRU_CACHE_CAPACITY``), of 1024 entries
each by default. An RL batch has new shapes every step, so both fill for hundreds of steps:
SmolLM2-135M's trainer grew about 35 MB a step past its measured estimate
(``scripts/bf16_primitive_cache.py``, docs/real-model.md). ``bound_kernel_caches`` caps both
for the process and the ones it starts, unless the environment already sets them; both are
read at the first bf16 product, so it works after ``import torch``, not after that product.

Imports: nothing of relayrl.
"""

from __future__ import annotations

import ctypes
import functools
import os
import resource

KERNEL_CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
KERNEL_CACHE_ENTRIES = 128


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


def bound_kernel_caches(entries: int = KERNEL_CACHE_ENTRIES) -> dict[str, str]:
    """Cap oneDNN's and ideep's kernel caches at ``entries`` each, for this process and its
    children, where the environment does not set them already; returns the settings in
    force. Call it before the process's first bf16 matrix product. ``entries`` must be at
    least 1: ideep crashes the process with an empty cache."""
    if entries < 1:
        raise ValueError(f"kernel caches need at least 1 entry, got {entries}")
    for name in KERNEL_CACHE_ENV:
        os.environ.setdefault(name, str(entries))
    return {name: os.environ[name] for name in KERNEL_CACHE_ENV}


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (Linux reports ``ru_maxrss`` in
    KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
