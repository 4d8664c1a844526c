"""The weight-transfer group of the broadcast transport on relayrl's side: the wire module
(``relayrl.engine.wire.relayrl_transfer_wire``, shared with the vLLM worker extension) with
relayrl's error type.

Owns: :class:`TransferGroup` (a :class:`WireGroup` whose failures are ``RelayError``) and
:func:`join_in_own_thread` (a server's join, off the event loop and off its shared executor);
the names below are re-exported from the wire module.

Imports: relayrl.engine.wire, relayrl.errors, the standard library.
"""

from __future__ import annotations

import asyncio
import threading

from relayrl.engine.wire.relayrl_transfer_wire import (
    BACKENDS,
    BUCKET_BYTES,
    DTYPES,
    WireGroup,
    buckets,
    dtype_from_name,
    dtype_name,
    tensor_specs,
)
from relayrl.errors import RelayError

__all__ = [
    "BACKENDS",
    "BUCKET_BYTES",
    "DTYPES",
    "TransferGroup",
    "buckets",
    "dtype_from_name",
    "dtype_name",
    "join_in_own_thread",
    "tensor_specs",
]


class TransferGroup(WireGroup):
    """A member of a weight-transfer group; a failed join or a closed group is a
    RelayError."""

    error = RelayError


async def join_in_own_thread(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    name: str,
    timeout_s: float,
    secret: str | None = None,
) -> TransferGroup:
    """:meth:`TransferGroup.join` on a thread of its own, not on the event loop's shared
    executor: a join for a group that its rank 0 already left can wait in gloo well past
    ``timeout_s``, and must hold neither a worker that the engine's calls need nor the next
    join. If the awaiting task is cancelled, a group joined afterwards is left at once."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[TransferGroup] = loop.create_future()

    def settle(group: TransferGroup | None, error: BaseException | None) -> None:
        if future.cancelled():
            if group is not None:
                group.close()
        elif error is not None:
            future.set_exception(error)
        else:
            future.set_result(group)

    def run() -> None:
        try:
            group = TransferGroup.join(
                master_address, master_port, rank, world_size, name, timeout_s, secret
            )
        except BaseException as exc:  # handed to the awaiting task
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, group, None)

    threading.Thread(target=run, name=f"relayrl-join-{name}", daemon=True).start()
    return await future
