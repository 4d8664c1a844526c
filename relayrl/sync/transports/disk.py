"""``train.weight_transport=disk``: a safetensors snapshot per publication, loaded by each
server from the filesystem (``/update_weights_from_disk``); built-in and vLLM servers alike.

Owns: :class:`DiskPublisher`. Imports: relayrl.engine.client, relayrl.errors and the
transports' base.
"""

from __future__ import annotations

from collections.abc import Awaitable
from pathlib import Path

from relayrl.engine.client import RolloutClient
from relayrl.errors import RelayError
from relayrl.sync.transports.base import Snapshot, WeightPublisher, WeightSource, register_transport


@register_transport
class DiskPublisher(WeightPublisher):
    """``train.weight_transport=disk``: a safetensors snapshot per publication, loaded by
    each server from the filesystem (``/update_weights_from_disk``)."""

    name = "disk"

    def snapshot(self, trainer: WeightSource, root: Path, version: int) -> Snapshot:
        return Snapshot(version, path=trainer.save_weights(root / f"v{version}"))

    async def transfer(self, client: RolloutClient, snapshot: Snapshot, keep_kv: bool) -> None:
        if snapshot.path is None:
            raise RelayError(f"publication v{snapshot.version} has no disk snapshot to load")
        await client.update_weights(str(snapshot.path), version=snapshot.version, keep_kv=keep_kv)

    def load_calls(
        self, client: RolloutClient, snapshot: Snapshot, keep_kv: bool
    ) -> dict[str, Awaitable[None]]:
        """One load per server, so a failure names its server; a subclass that overrides
        :meth:`transfer` (a plugin's transport) gets its one transfer call instead."""
        if type(self).transfer is not DiskPublisher.transfer or snapshot.path is None:
            return super().load_calls(client, snapshot, keep_kv)
        path, version = str(snapshot.path), snapshot.version
        return {
            u: client.update_weights(path, version=version, urls=[u], keep_kv=keep_kv)
            for u in client.urls
        }
