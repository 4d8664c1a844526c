"""LoRA adapter publications on the built-in engine (docs/lora.md "What is published").

Owns: the adapter snapshot format (:data:`ADAPTER_FILE` in a snapshot directory: for each
adapted linear module ``M`` of the model, ``M.lora_A`` (r × in) and ``M.lora_B`` (out × r);
the scale ``alpha / r`` and the checksum of the merged weights in the file's metadata),
:func:`is_adapter_snapshot`, :func:`read_adapter`, :func:`write_adapter`,
:func:`adapter_from_tensors` and :func:`check_adapter_shapes` (an adapter that arrives by
broadcast: its ``<module>.lora_A`` / ``.lora_B`` tensors, checked before they are received),
:func:`check_adapter`, :func:`merge_weight` (W = W_base + scale · B·A, computed the same way on the trainer and on a
server, so both hold bit-identical merged weights), :func:`merged_named` (a model's weights
with an adapter merged, for the checksum) and :class:`AdapterBase` (merge-into-a-copy: a
server keeps the pristine base weight of every module an adapter touches, and each adapter
publication sets W = W_base + scale · B·A from it, so the base never drifts and an adapter
replaces the previous one instead of adding to it), and :func:`peft_dir` (an adapter snapshot
as a standard PEFT adapter directory, content-addressed, which vLLM's dynamic LoRA loads).

Imports: relayrl.engine.weights, relayrl.engine.wire, relayrl.errors, safetensors, torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from relayrl.engine.weights import weights_checksum
from relayrl.engine.wire.relayrl_peft_wire import write_peft
from relayrl.errors import RelayError

ADAPTER_FILE = "relayrl_adapter.safetensors"
LORA_A, LORA_B = ".lora_A", ".lora_B"

__all__ = [
    "ADAPTER_FILE",
    "Adapter",
    "AdapterBase",
    "adapter_from_tensors",
    "check_adapter",
    "check_adapter_shapes",
    "is_adapter_snapshot",
    "merge_weight",
    "merged_checksum",
    "merged_named",
    "peft_dir",
    "read_adapter",
    "write_adapter",
    "write_peft_dir",
]


@dataclass
class Adapter:
    """``pairs``: module name -> (A, B); ``scale``: alpha / r; ``checksum``: the trainer's
    ``weights_checksum`` of the merged model (None: not recorded)."""

    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]
    scale: float
    checksum: str | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """``<module>.lora_A`` / ``<module>.lora_B`` -> tensor (what a snapshot file holds
        and a broadcast sends, in this order)."""
        out: dict[str, torch.Tensor] = {}
        for module, (a, b) in self.pairs.items():
            out[module + LORA_A], out[module + LORA_B] = a, b
        return out

    def cpu_copy(self) -> Adapter:
        """A detached CPU copy (the trainer trains on while a publication holds it)."""
        pairs = {
            m: (a.detach().to("cpu", copy=True), b.detach().to("cpu", copy=True))
            for m, (a, b) in self.pairs.items()
        }
        return Adapter(pairs, self.scale, self.checksum)


def merge_weight(
    base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float
) -> torch.Tensor:
    """``base + scale · B·A`` in ``base``'s dtype. The product is a sum of r outer products
    taken one by one with elementwise float32 operations (no matrix multiply, whose
    summation order depends on the BLAS and its threads): the same bits on every machine."""
    a32, b32 = a.detach().float().to(base.device), b.detach().float().to(base.device)
    delta = torch.mul(b32[:, :1], a32[:1, :])
    term = torch.empty_like(delta)
    for k in range(1, a32.shape[0]):
        delta.add_(torch.mul(b32[:, k : k + 1], a32[k : k + 1, :], out=term))
    return delta.mul_(scale).add_(base.detach().float()).to(base.dtype)


def merged_named(
    named: Iterable[tuple[str, torch.Tensor]], adapter: Adapter
) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` (a model's base weights) with each adapted ``M.weight`` merged."""
    for name, tensor in named:
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in adapter.pairs:
            a, b = adapter.pairs[module]
            yield name, merge_weight(tensor, a, b, adapter.scale)
        else:
            yield name, tensor


def merged_checksum(named: Iterable[tuple[str, torch.Tensor]], adapter: Adapter) -> str:
    """``weights_checksum`` of ``named`` with ``adapter`` merged (what a server reports)."""
    return weights_checksum(merged_named(named, adapter))


def write_adapter(adapter: Adapter, directory: Path) -> Path:
    """Write ``adapter`` as an adapter snapshot in ``directory``; returns ``directory``."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: t.detach().to("cpu").contiguous() for k, t in adapter.tensors().items()}
    meta = {"scale": repr(float(adapter.scale)), "checksum": adapter.checksum or ""}
    save_file(tensors, str(directory / ADAPTER_FILE), metadata=meta)
    return directory


def is_adapter_snapshot(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding an adapter snapshot."""
    return (Path(path) / ADAPTER_FILE).is_file()


def read_adapter(path: str | Path) -> Adapter:
    """The adapter snapshot in directory ``path``; RelayError when it is malformed."""
    from safetensors import safe_open

    file = Path(path) / ADAPTER_FILE
    try:
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
        scale = float(meta["scale"])
    except Exception as exc:  # noqa: BLE001 - safetensors and a missing key raise several kinds
        raise RelayError(f"cannot read adapter snapshot {str(file)!r}: {exc}") from exc
    return adapter_from_tensors(
        tensors, scale, f"adapter snapshot {str(file)!r}", meta.get("checksum") or None
    )


def adapter_modules(names: Iterable[str], where: str) -> list[str]:
    """The modules of an adapter's tensor ``names`` (``<module>.lora_A`` and
    ``<module>.lora_B`` each); RelayError naming ``where`` when a name does not pair up."""
    names = set(names)
    modules = {k.removesuffix(LORA_A) for k in names if k.endswith(LORA_A)}
    if not modules or {m + s for m in modules for s in (LORA_A, LORA_B)} != names:
        raise RelayError(
            f"{where}: every module needs exactly '<module>{LORA_A}' and '<module>{LORA_B}'"
        )
    return sorted(modules)


def adapter_from_tensors(
    tensors: Mapping[str, torch.Tensor], scale: float, where: str, checksum: str | None = None
) -> Adapter:
    """An :class:`Adapter` of ``<module>.lora_A`` / ``<module>.lora_B`` tensors (a snapshot
    file's, or a broadcast's); RelayError naming ``where`` when they do not pair up."""
    pairs = {
        m: (tensors[m + LORA_A], tensors[m + LORA_B])
        for m in adapter_modules(tensors.keys(), where)
    }
    return Adapter(pairs, float(scale), checksum)


def check_adapter_fit(
    params: Mapping[str, torch.Tensor], module: str, a_shape: Sequence[int], b_shape: Sequence[int]
) -> None:
    """RelayError unless ``module`` is a linear layer of ``params`` (a model's parameters by
    name) that a ``lora_A`` of ``a_shape`` and a ``lora_B`` of ``b_shape`` fit."""
    weight = params.get(module + ".weight")
    if weight is None or weight.dim() != 2:
        raise RelayError(f"adapter module {module!r} is not a linear layer of the model")
    out, inp = weight.shape
    a, b = tuple(a_shape), tuple(b_shape)
    if len(a) != 2 or len(b) != 2 or a[1] != inp or b != (out, a[0]):
        raise RelayError(
            f"adapter module {module!r}: lora_A {a} and lora_B {b} do not fit the weight "
            f"{(out, inp)}"
        )


def check_adapter_shapes(model: torch.nn.Module, shapes: Mapping[str, Sequence[int]]) -> None:
    """RelayError unless ``shapes`` (tensor name -> shape: a broadcast adapter's, checked
    before anything is received) is an adapter that fits ``model``."""
    params = dict(model.named_parameters())
    for module in adapter_modules(shapes.keys(), "the adapter's names"):
        check_adapter_fit(params, module, shapes[module + LORA_A], shapes[module + LORA_B])


def check_adapter(model: torch.nn.Module, adapter: Adapter) -> None:
    """RelayError unless every module of ``adapter`` is a linear layer of ``model`` whose
    weight its lora_A / lora_B fit."""
    params = dict(model.named_parameters())
    for module, (a, b) in adapter.pairs.items():
        check_adapter_fit(params, module, a.shape, b.shape)


class AdapterBase:
    """A server's pristine base weights of the modules adapters have touched (see the
    module docstring). A full-weight load makes the loaded weights the new base
    (:meth:`reset`)."""

    def __init__(self) -> None:
        self.bases: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        self.bases.clear()

    def merged_state(self, model: torch.nn.Module, adapter: Adapter) -> dict[str, torch.Tensor]:
        """The weights to write into ``model`` for ``adapter``: merged for each adapted
        module, the pristine base for one an earlier adapter touched and this one does not.
        Every name and shape is checked first (RelayError; the model is not changed)."""
        check_adapter(model, adapter)
        params = dict(model.named_parameters())
        state: dict[str, torch.Tensor] = {}
        for module, (a, b) in adapter.pairs.items():
            name = module + ".weight"
            base = self.bases.setdefault(name, params[name].detach().clone())
            state[name] = merge_weight(base, a, b, adapter.scale)
        for name, base in self.bases.items():
            state.setdefault(name, base)
        return state

    def base_checksum(self, model: torch.nn.Module) -> str:
        """``weights_checksum`` of the base model the server keeps (the pristine copies in
        place of the merged weights): unchanged by any number of adapter publications."""
        return weights_checksum((n, self.bases.get(n, p)) for n, p in model.named_parameters())


def load_partial(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy ``state`` (some of ``model``'s parameters, already checked) into ``model``."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)


PEFT_SUBDIR = "peft-"  # + the adapter file's digest: a snapshot's PEFT directory


def write_peft_dir(adapter: Adapter, directory: Path) -> Path:
    """Write ``adapter`` as a standard PEFT LoRA directory in ``directory`` (the wire
    module's :func:`write_peft`, which the vLLM worker extension writes with too).
    RelayError when the modules' ranks differ (one ``r`` per PEFT directory)."""
    try:
        return write_peft(adapter.pairs, adapter.scale, directory)
    except ValueError as exc:
        raise RelayError(str(exc)) from exc


def peft_dir(snapshot: str | Path) -> Path:
    """The PEFT directory of the adapter snapshot in ``snapshot``, written on first use:
    ``<snapshot>/peft-<digest>``, named after the adapter file's content, so a server that
    keys its caches by the adapter's path (vLLM's prefix cache does) never mistakes one
    adapter for another, even when a later run reuses the version's directory."""
    import hashlib

    file = Path(snapshot) / ADAPTER_FILE
    try:
        digest = hashlib.sha256(file.read_bytes()).hexdigest()[:16]
    except OSError as exc:
        raise RelayError(f"cannot read adapter snapshot {str(file)!r}: {exc}") from exc
    directory = Path(snapshot) / (PEFT_SUBDIR + digest)
    if not directory.is_dir():
        write_peft_dir(read_adapter(snapshot), directory)
    return directory
