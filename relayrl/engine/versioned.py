"""The last K adapter versions served at once (``relayrl serve --max-adapters K``,
docs/lora.md "The last K policies at once").

Owns :class:`VersionedAdapters`: up to K LoRA adapters keyed by weight version, applied in
the forward pass instead of merged into the weights. The model's weights stay the base; a
forward hook on every adapted linear module adds ``scale · (x·Aᵀ)·Bᵀ`` of the adapter of
*each row's* version, so one batch decodes requests of different versions side by side and a
publication needs to interrupt none of them: a request keeps the version it was admitted
under, and every token it samples is exactly that version's. Rows of a version without an
adapter (the base, e.g. version 0) get no delta. This is the unmerged LoRA forward the
trainer runs (peft: ``base(x) + lora_B(lora_A(x)) · scale``), so the logprobs agree with the
trainer's to float rounding.

Touched only by the engine's loop thread.

Imports: relayrl.engine.adapter, relayrl.errors, torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from relayrl.engine.adapter import Adapter, check_adapter
from relayrl.errors import RelayError

__all__ = ["VersionedAdapters"]


class VersionedAdapters:
    """Up to ``capacity`` adapters by version, applied per batch row (module docstring)."""

    def __init__(self, model: torch.nn.Module, capacity: int) -> None:
        if capacity < 2:
            raise ValueError(f"capacity must be >= 2 (1 is merge-into-a-copy), got {capacity}")
        self.model = model
        self.capacity = capacity
        self.adapters: OrderedDict[int, Adapter] = OrderedDict()  # oldest first
        self._modules = dict(model.named_modules())
        self._hooked: dict[str, torch.utils.hooks.RemovableHandle] = {}
        self._rows: list[tuple[int, torch.Tensor | None]] = []  # (version, rows or all)

    def __contains__(self, version: int) -> bool:
        return version in self.adapters

    @property
    def versions(self) -> list[int]:
        return list(self.adapters)

    def add(self, version: int, adapter: Adapter) -> list[int]:
        """Keep ``adapter`` as ``version``'s; returns the versions evicted to stay within the
        capacity (oldest first). Every module is checked first (RelayError; nothing kept)."""
        check_adapter(self.model, adapter)
        if self.adapters and version <= next(reversed(self.adapters)):
            raise RelayError(
                f"adapter version {version} is not newer than the newest kept "
                f"({next(reversed(self.adapters))}); versions must increase"
            )
        self.adapters[version] = adapter
        for module in adapter.pairs:
            self._hook(module)
        evicted = []
        while len(self.adapters) > self.capacity:
            evicted.append(self.adapters.popitem(last=False)[0])
        return evicted

    def clear(self) -> None:
        """Forget every adapter (a full-weight load replaced the base)."""
        self.adapters.clear()

    def route(self, versions: Sequence[int]) -> None:
        """The version of each row of the next forward passes' batch."""
        distinct = sorted(set(versions))
        if len(distinct) == 1:
            self._rows = [(distinct[0], None)]
            return
        column = torch.tensor(list(versions))
        self._rows = [(v, torch.nonzero(column == v)[:, 0]) for v in distinct]

    def _hook(self, module_name: str) -> None:
        if module_name in self._hooked:
            return
        module = self._modules[module_name]

        def add_deltas(_module, inputs, output):
            return self._apply(module_name, inputs[0], output)

        self._hooked[module_name] = module.register_forward_hook(add_deltas)

    def _apply(self, module_name: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        for version, rows in self._rows:
            adapter = self.adapters.get(version)
            pair = adapter.pairs.get(module_name) if adapter is not None else None
            if pair is None:
                continue
            a, b = (t.to(device=x.device, dtype=x.dtype) for t in pair)
            if rows is None:
                out = out + (x @ a.T) @ b.T * adapter.scale
            else:
                rows = rows.to(x.device)
                out = out.index_add(0, rows, (x[rows] @ a.T) @ b.T * adapter.scale)
        return out
