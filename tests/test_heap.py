"""relayrl.heap: freed tensors of changing sizes stay in glibc's heap until
``release_free_heap`` hands them back (the trainer calls it after every step)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from relayrl.heap import (
    KERNEL_CACHE_ENTRIES,
    KERNEL_CACHE_ENV,
    bound_kernel_caches,
    release_free_heap,
)

# Tensors of 1-8 MB, freed with small live tensors allocated between the rounds. In a long
# run glibc's dynamic mmap threshold soon serves such sizes from its heap, where freed memory
# stays; the test pins that state (MALLOC_MMAP_THRESHOLD_ above the sizes, no trimming on
# free) rather than relying on the order of the first frees, which left only ~50 MB in the
# heap on one CI machine
SCRIPT = """
import random, torch
from relayrl.heap import release_free_heap
torch.set_num_threads(1)

def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20

rng, keep = random.Random(0), []
base = rss_mb()
for _ in range(6):
    batch = [torch.ones(rng.randrange(256, 2048) * 1024) for _ in range(60)]
    keep.append(torch.ones(1000))
    del batch
before = rss_mb()
print(base, before, rss_mb() if release_free_heap() else -1)
"""

HEAP_ONLY = {"MALLOC_MMAP_THRESHOLD_": str(64 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}

# `relayrl --help` exits after the CLI's first settings; a process it would start sees them
CLI_THEN_CHILD = """
import contextlib, subprocess, sys
from relayrl.cli import main
with contextlib.suppress(SystemExit), contextlib.redirect_stdout(sys.stderr):
    main(["--help"])
names = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
code = "import os; print(*(os.environ[n] for n in %r))" % (names,)
subprocess.run([sys.executable, "-c", code], check=True)
"""


def _python(code: str, *args: str, env: dict[str, str], timeout: float = 120) -> str:
    """Run ``code`` in a fresh Python with ``env``; its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=True,
    )
    return done.stdout


def _without_kernel_cache_settings() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in KERNEL_CACHE_ENV}


def test_freed_tensors_go_back_to_the_os_only_when_released() -> None:
    if not release_free_heap():
        pytest.skip("the C library has no malloc_trim (not glibc)")
    base, before, after = map(int, _python(SCRIPT, env={**os.environ, **HEAP_ONLY}).split())
    # ~300 MB freed and kept, then handed back (measured on a 2-core EPYC: 220 MB at the
    # start, 510 before the release, 220 after)
    assert before - base > 200, (base, before, after)
    assert after - base < (before - base) / 4, (base, before, after)


def test_kernel_caches_are_capped_unless_the_environment_says_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "512")  # the user's own setting stays
    assert bound_kernel_caches(32) == {
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "32",
        "LRU_CACHE_CAPACITY": "512",
    }
    with pytest.raises(ValueError, match="at least 1 entry"):
        bound_kernel_caches(0)  # ideep segfaults on an empty cache


def test_relayrl_commands_cap_the_kernel_caches_for_the_processes_they_start() -> None:
    out = _python(CLI_THEN_CHILD, env=_without_kernel_cache_settings())
    assert out.split() == [str(KERNEL_CACHE_ENTRIES)] * 2


# A bf16 Linear(576, 4096) forward and backward at 150 new row counts, the C heap trimmed
# after each: what stays is the kernel caches' (measured on a 2-core Xeon with AMX: 406 MiB
# with the default 1024 entries, 16 MiB with 8)
NEW_SHAPES = """
import sys, torch
from relayrl.heap import bound_kernel_caches, release_free_heap
if sys.argv[1] != "default":
    bound_kernel_caches(int(sys.argv[1]))
torch.set_num_threads(1)

def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20

layer = torch.nn.Linear(576, 4096).to(torch.bfloat16)
layer(torch.randn(8, 576, dtype=torch.bfloat16))
release_free_heap()
before = rss_mb()
for rows in range(9, 159):
    x = torch.randn(rows, 576, dtype=torch.bfloat16, requires_grad=True)
    layer(x).float().sum().backward()
    release_free_heap()
print(rss_mb() - before)
"""


def _growth_mb(entries: str) -> int:
    return int(_python(NEW_SHAPES, entries, env=_without_kernel_cache_settings(), timeout=300))


def test_capped_kernel_caches_bound_the_memory_new_bf16_shapes_keep() -> None:
    from relayrl.models.precision import cpu_has_fast_bf16

    if not release_free_heap():
        pytest.skip("the C library has no malloc_trim (not glibc)")
    if not cpu_has_fast_bf16():
        pytest.skip("this CPU emulates bf16: relayrl's `auto` precision runs float32 here")
    default, capped = _growth_mb("default"), _growth_mb("8")
    assert default > 150 and capped < default / 4, (default, capped)
