"""The weight transports (``train.weight_transport``, docs/cluster.md "Weight transports"):
how a publication's weights travel from the trainer to the rollout servers. The sending
side only; what a server does with what it receives is ``relayrl.engine``'s
(``engine.transfer``'s receiving rank, ``/update_weights_from_disk``).

One module per piece: ``base`` (:class:`WeightPublisher`, :class:`Snapshot`,
:class:`WeightSource`, :class:`ModelSource`, :func:`register_transport`,
:func:`make_publisher`), ``disk`` (:class:`DiskPublisher`) and ``broadcast``
(:class:`BroadcastPublisher`). The names below are this package's API: a plugin's
transport subclasses :class:`WeightPublisher` and registers itself (docs/extending.md).

Imports: relayrl.config, relayrl.engine, relayrl.launch.servers (free ports),
relayrl.errors, relayrl.registry.
"""

from relayrl.sync.transports.base import (
    ModelSource,
    Snapshot,
    WeightPublisher,
    WeightSource,
    make_publisher,
    register_transport,
)
from relayrl.sync.transports.broadcast import BroadcastError, BroadcastPublisher
from relayrl.sync.transports.disk import DiskPublisher

__all__ = [
    "BroadcastError",
    "BroadcastPublisher",
    "DiskPublisher",
    "ModelSource",
    "Snapshot",
    "WeightPublisher",
    "WeightSource",
    "make_publisher",
    "register_transport",
]
