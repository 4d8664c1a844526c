"""The process-wide settings of a training process, set in one place when a run starts.

Owns: :func:`process_settings`: torch's intra-op threads (``train.trainer_threads``), the
GIL switch interval (``train.switch_interval_ms``, restored when the run ends, so a test
process running several runs is left as it was), cuDNN out of attention on CUDA
(``relayrl.models.loading.prefer_shape_agnostic_attention``) and libraries' progress bars
off (relayrl's dashboard is the run's display, ``relayrl.models.loading.quiet_libraries``)
and the bf16 kernel caches capped (``relayrl.heap.bound_kernel_caches``).
The SFT warm start (``relayrl.train.sft``) and the rollout servers (``relayrl.engine.serve``)
set their own thread counts at their start.

Imports: torch, config, heap, models.loading.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch

from relayrl.config.schema import RunConfig
from relayrl.heap import bound_kernel_caches
from relayrl.models.loading import prefer_shape_agnostic_attention, quiet_libraries


@contextlib.contextmanager
def process_settings(config: RunConfig) -> Iterator[None]:
    """Apply the trainer process's settings for the run inside the ``with`` block."""
    torch.set_num_threads(config.train.trainer_threads)
    bound_kernel_caches()  # a trainer started by Ray, not by relayrl's CLI
    prefer_shape_agnostic_attention(config.model.device)
    quiet_libraries()
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(config.train.switch_interval_ms / 1000)
    try:
        yield
    finally:
        sys.setswitchinterval(switch_interval)
