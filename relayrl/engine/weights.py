"""Loading new weights into a live model: from a safetensors file, a Hugging Face directory of
safetensors shards, or an in-memory state dict (a disk publication or a broadcast one). Every
tensor is checked (name, shape) before any parameter is overwritten, so a bad update leaves
the model unchanged. :func:`weights_checksum` (the wire module's, which the vLLM worker extension
computes too): one digest of a set of weights, the same on the trainer and on a server
holding the same values.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from relayrl.engine.wire.relayrl_transfer_wire import served_checksum, weights_checksum
from relayrl.errors import RelayError

__all__ = [
    "check_shapes",
    "load_into",
    "model_checksum",
    "read_state_dict",
    "served_checksum",
    "weights_checksum",
]


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of ``path`` (a ``.safetensors`` file or a directory of them)."""
    from safetensors.torch import load_file

    p = Path(path)
    if p.is_file() and p.suffix == ".safetensors":
        files = [p]
    elif p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise RelayError(f"weights directory {str(p)!r} contains no *.safetensors file")
    else:
        raise RelayError(
            f"weights path {str(p)!r} does not exist or is neither a directory "
            "nor a .safetensors file"
        )
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as exc:  # noqa: BLE001 - safetensors raises several kinds
            raise RelayError(f"cannot read weights file {str(f)!r}: {exc}") from exc
    return state


def _tied_names(model: torch.nn.Module) -> set[str]:
    """Parameter names that share storage with an earlier parameter (tied embeddings)."""
    seen: dict[int, str] = {}
    tied: set[str] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        key = param.data_ptr()
        if key in seen:
            tied.add(name)
        else:
            seen[key] = name
    return tied


def check_shapes(model: torch.nn.Module, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """RelayError unless ``shapes`` (name -> shape) covers exactly ``model``'s tensors, each
    with the model's shape (tied tensors may be given once)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    params.update(dict(model.named_buffers()))
    unknown = sorted(set(shapes) - set(params))
    if unknown:
        raise RelayError(f"weights contain tensors the model does not have: {unknown[:5]}")
    missing = sorted(set(params) - set(shapes) - _tied_names(model))
    missing = [n for n in missing if n in dict(model.named_parameters())]
    if missing:
        raise RelayError(f"weights are missing tensors of the model: {missing[:5]}")
    for name, shape in shapes.items():
        if tuple(shape) != tuple(params[name].shape):
            raise RelayError(
                f"weight {name!r} has shape {tuple(shape)}, "
                f"the model expects {tuple(params[name].shape)}"
            )


def load_into(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy ``state`` into ``model`` in place after checking every name and shape."""
    check_shapes(model, {name: tuple(t.shape) for name, t in state.items()})
    params = dict(model.named_parameters(remove_duplicate=False))
    params.update(dict(model.named_buffers()))
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor.to(params[name].device, params[name].dtype))


def model_checksum(model: torch.nn.Module) -> str:
    """:func:`weights_checksum` of ``model``'s parameters (a tied tensor once)."""
    return weights_checksum(model.named_parameters())
