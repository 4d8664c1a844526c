"""The weight-transfer group of the broadcast transport on relayrl's side: the wire module
(``relayrl.engine.wire.relayrl_transfer_wire``, shared with the vLLM worker extension) with
relayrl's error type.

Owns: :class:`TransferGroup` (a :class:`WireGroup` whose failures are ``RelayError``); the
names below are re-exported from the wire module.

Imports: relayrl.engine.wire, relayrl.errors.
"""

from __future__ import annotations

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
    "tensor_specs",
]


class TransferGroup(WireGroup):
    """A member of a weight-transfer group; a failed join or a closed group is a
    RelayError."""

    error = RelayError
