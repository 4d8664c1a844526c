"""Whether bf16 compute is fast on a device: what ``auto`` precision settings resolve to.

On a CPU, bf16 is fast only with hardware kernels (AVX-512 BF16, AMX) or AVX-512; on an
AVX2-only CPU oneDNN emulates it, 6.2x float32's time on SmolLM2-135M's MLP shape and 3.7x
on the recipe's evaluation (docs/real-model.md), so a recipe written for bf16 runs there in
float32.
"""

from __future__ import annotations

import torch


def cpu_has_fast_bf16() -> bool:
    """oneDNN's own answer: bf16 kernels in hardware (AVX-512 BF16, AMX) or AVX-512."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False


def bf16_is_fast(device: str) -> bool:
    """bf16 compute beats float32 on ``device`` (a torch device string). A CUDA device this
    process cannot see (a driver resolving a config for a GPU node) counts as fast: every
    GPU relayrl targets has bf16 tensor cores."""
    if device.startswith("cpu"):
        return cpu_has_fast_bf16()
    if device.startswith("cuda") and torch.cuda.is_available():
        return bool(torch.cuda.is_bf16_supported())
    return True
