"""The weight transports' common interface (docs/cluster.md "Weight transports").

Owns: :class:`Snapshot` (one publication: its version, the disk snapshot if one was
written, the in-memory weights if they are to be broadcast), :class:`WeightSource` (what a
publisher snapshots: the trainer, or a bare model as :class:`ModelSource`),
:class:`WeightPublisher` (one transport), :func:`register_transport` (into
``relayrl.registry.WEIGHT_TRANSPORTS``, the names ``train.weight_transport`` accepts: a
plugin's transport is one subclass and one registry line, docs/extending.md),
:func:`make_publisher`, and the helpers that write held weights to disk.

A publisher is used in two places, both ``relayrl.sync.weight_sync.WeightSync``'s: the trainer side calls
:meth:`WeightPublisher.snapshot` while the trainer is held (a consistent copy of the
weights), then the publication transaction (``relayrl.sync.transaction.Transaction``, under
the supervisor's lock) calls :meth:`WeightPublisher.transfer` as its load step
(:meth:`WeightPublisher.load`, pause / transfer / resume with no deadlines or checks, is
what the benchmarks and transport tests drive directly); when the supervisor restarts a
server, ``WeightSync`` calls :meth:`WeightPublisher.restart_snapshot` (what the
replacement loads) and :meth:`WeightPublisher.server_replaced`.

Imports: relayrl.config (the train section), relayrl.engine (adapter, client),
relayrl.errors, relayrl.registry, torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from relayrl.config.schema import TrainConfig
from relayrl.engine.adapter import Adapter, write_adapter
from relayrl.engine.client import RolloutClient
from relayrl.errors import RelayError
from relayrl.registry import WEIGHT_TRANSPORTS


class WeightSource(Protocol):
    """What a publisher snapshots: the trainer (single-process, data-parallel or FSDP).
    A LoRA trainer also has ``lora_adapter()`` (its adapters as an ``Adapter``, with the
    merged weights' checksum; None without LoRA): the broadcast sends only those."""

    model: torch.nn.Module

    def save_weights(self, directory: Path) -> Path: ...


@dataclass
class Snapshot:
    """One publication. ``path``: the disk snapshot written for it (None: broadcast only);
    ``state``: a CPU copy of the weights to broadcast (None: disk only); ``checksum``: the
    published weights' ``weights_checksum`` (None: not verified); ``adapter``: a LoRA
    publication's adapters (a CPU copy; ``state`` holds their tensors, and the checksum is
    the merged weights' the trainer recorded in it)."""

    version: int
    path: Path | None = None
    state: Mapping[str, torch.Tensor] | None = None
    checksum: str | None = None
    adapter: Adapter | None = None


def lora_adapter(trainer: WeightSource) -> Adapter | None:
    """The trainer's adapters as one publication under LoRA, else None."""
    getter = getattr(trainer, "lora_adapter", None)
    return getter() if getter is not None else None


def save_held(snapshot: Snapshot, directory: Path) -> Path:
    """Write the weights ``snapshot`` holds as a disk snapshot in ``directory``: an adapter
    snapshot for a LoRA publication, else ``model.safetensors``."""
    if snapshot.adapter is not None:
        return write_adapter(snapshot.adapter, directory)
    assert snapshot.state is not None
    return save_state(snapshot.state, directory)


def cpu_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of ``model``'s parameters, a tied tensor once (the engine's loader expects
    exactly that, as in a disk snapshot): the trainer trains on while it is broadcast."""
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}


def save_state(state: Mapping[str, torch.Tensor], directory: Path) -> Path:
    """Write ``state`` as a disk snapshot (``directory/model.safetensors``, as the trainer
    writes one); returns ``directory``."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file(dict(state), str(directory / "model.safetensors"))
    return directory


class ModelSource:
    """A bare model as a :class:`WeightSource`, its disk snapshot written as the trainer
    writes one (``model.safetensors``, a tied tensor once): benchmarks and tests publish
    with it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def save_weights(self, directory: Path) -> Path:
        return save_state(cpu_weights(self.model), directory)


class WeightPublisher(ABC):
    """One weight transport; see the module docstring for who calls what."""

    name: str

    @classmethod
    def from_config(cls, train: TrainConfig) -> WeightPublisher:
        """The publisher a run with this ``train`` section uses (the default: no options)."""
        return cls()

    @abstractmethod
    def snapshot(self, trainer: WeightSource, root: Path, version: int) -> Snapshot:
        """Capture the trainer's weights for publication ``version`` (blocking; the trainer
        is held meanwhile); a disk snapshot goes to ``root/v<version>``."""

    @abstractmethod
    async def transfer(self, client: RolloutClient, snapshot: Snapshot, keep_kv: bool) -> None:
        """Put ``snapshot`` on every server of ``client`` (as one load each)."""

    def load_calls(
        self, client: RolloutClient, snapshot: Snapshot, keep_kv: bool
    ) -> dict[str, Awaitable[None]]:
        """The calls of a publication's load step (``relayrl.sync.transaction``), keyed by
        the server(s) each names when it fails: by default one :meth:`transfer` to every
        server (one broadcast reaches them all)."""
        return {", ".join(client.urls): self.transfer(client, snapshot, keep_kv)}

    async def load(self, client: RolloutClient, snapshot: Snapshot, mode: str) -> None:
        """Publish ``snapshot`` under ``train.publish_mode`` ``mode``: ``abort``: pause
        (aborting running requests, which the client resubmits), load, continue;
        ``retract``: load only, each server re-queues its running requests itself;
        ``inflight``: load only, running requests keep their KV."""
        if mode != "abort":
            await self.transfer(client, snapshot, keep_kv=mode == "inflight")
            return
        await client.pause("abort")
        try:
            await self.transfer(client, snapshot, keep_kv=False)
        finally:
            await client.continue_generation()

    def stats(self) -> dict[str, float]:
        """Counters for the run's summary."""
        return {}

    def server_replaced(self, old: str, new: str) -> None:  # noqa: B027 - optional hook
        """Server ``old`` was restarted at ``new`` (it holds the last disk snapshot)."""

    def restart_snapshot(self, snapshot: Snapshot) -> Path | None:
        """A disk snapshot of ``snapshot`` for a restarted server to load (None: none can be
        written); blocking."""
        return snapshot.path

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the transport holds (the end of the run)."""


def register_transport(cls: type[WeightPublisher]) -> type[WeightPublisher]:
    """Class decorator: make ``cls`` (a :class:`WeightPublisher` with a ``name``) a choice of
    ``train.weight_transport``."""
    if not (isinstance(cls, type) and issubclass(cls, WeightPublisher)):
        raise TypeError(f"a weight transport must subclass WeightPublisher, got {cls!r}")
    return WEIGHT_TRANSPORTS.add_class(cls)


def make_publisher(train: TrainConfig) -> WeightPublisher:
    """The publisher of ``train.weight_transport``."""
    try:
        cls = WEIGHT_TRANSPORTS.lookup(train.weight_transport)
    except ValueError as exc:
        raise RelayError(f"train.weight_transport: {exc}") from None
    return cls.from_config(train)
