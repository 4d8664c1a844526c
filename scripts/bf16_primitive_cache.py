"""How much resident memory bf16 matrix products keep per new shape on a CPU, side by side.

    python scripts/bf16_primitive_cache.py [--steps 60] [--quick]

An RL step's tensors change shape with every batch (sequence lengths, packed rows, the
completion positions of the output head). In bfloat16 on a CPU, PyTorch runs a matrix
product through oneDNN, which compiles a primitive per shape and keeps it in two caches of
1024 entries each by default (oneDNN's own, ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, and ideep's in
PyTorch, ``LRU_CACHE_CAPACITY``); float32 products do not. This script runs ``--steps``
forward and backward passes of a 30-layer stack of ``Linear(576, 576)`` and an output head
under bf16 autocast, each step at a new random row count (as a trainer's micro-batches),
after one warm-up step, in child processes with the caches at their defaults, capped, and in float32, the C heap
trimmed after every step (``malloc_trim``), and prints each one's resident-memory growth and
seconds. Last line ``bf16_default_growth_mb=X``.

It is the probe behind docs/real-model.md's note on the bf16 recipe's memory: without the
trim the growth would hide under the heap's; with it, what remains is the caches'. relayrl's
processes now cap both caches (``relayrl.heap.bound_kernel_caches``, 128 entries); this
script sets them per variant (the caller's settings dropped) and does not go through
relayrl's CLI.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import subprocess
import sys
import time

CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
VARIANTS = {
    "bf16, default caches": {},
    "bf16, caches of 64": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"},
    "float32": {"PROBE_FLOAT32": "1"},
}


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def child(steps: int) -> None:
    import torch

    torch.set_num_threads(1)
    libc = ctypes.CDLL("libc.so.6")
    layers = torch.nn.Sequential(*[torch.nn.Linear(576, 576) for _ in range(30)])
    head = torch.nn.Linear(576, 4096, bias=False)
    bf16 = not os.environ.get("PROBE_FLOAT32")
    rng = random.Random(0)

    def step(rows: int) -> None:
        x = torch.randn(rows, 576, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y = head(layers(x))
        y.float().sum().backward()
        libc.malloc_trim(0)

    step(2000)  # the gradients' first allocation, so the growth below is per-shape only
    start_mb, start = rss_mb(), time.perf_counter()
    for _ in range(steps):
        step(rng.randint(200, 2000))
    print(f"{rss_mb() - start_mb:.0f} {time.perf_counter() - start:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--quick", action="store_true", help="20 steps")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    steps = 20 if args.quick else args.steps
    if args.child:
        child(steps)
        return
    growth = {}
    for name, env in VARIANTS.items():
        out = subprocess.run(
            [sys.executable, __file__, "--child", "--steps", str(steps)],
            env={**{k: v for k, v in os.environ.items() if k not in CACHE_ENV}, **env},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        growth[name] = float(out[0])
        print(f"{name:22s} resident memory +{out[0]} MiB over {steps} steps, {out[1]} s")
    print(f"bf16_default_growth_mb={growth['bf16, default caches']:.0f}")


if __name__ == "__main__":
    main()
