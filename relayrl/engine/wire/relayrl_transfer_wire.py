"""The weight-transfer group of the broadcast transport and its wire format (docs/cluster.md
"Weight transports"): the trainer is rank 0, each rollout server one rank after it, and every
tensor of a publication travels from rank 0 to all by one gloo broadcast.

Owns: :class:`WireGroup` (join, send, receive, close), the dtype names on the wire,
:func:`tensor_specs` (the names / dtypes / shapes a publication announces over HTTP) and
:func:`buckets` (how the tensors are cut into broadcasts). Both ends load this one module:
relayrl as ``relayrl.engine.wire.relayrl_transfer_wire`` (``relayrl.engine.transfer`` gives
its group relayrl's error type) and the vLLM worker extension as ``relayrl_transfer_wire``,
so it imports only the standard library and torch.

The group never touches torch.distributed's default group: it is a ``ProcessGroupGloo`` built
directly over its own ``TCPStore`` (rank 0 hosts it) under a ``PrefixStore`` named after the
group, so the trainer can be an FSDP program with a default group of its own, and a group can
be re-formed under a new name (after a server restart) without tearing anything else down.
The store listens on the group's interface only (loopback for a single-host group), only
while the group forms (:func:`stop_listening`), and the group's keys live under a prefix
derived from the run's secret (:func:`store_prefix`).
Tensors travel in buckets (:func:`buckets`: consecutive tensors of one dtype flattened into
one buffer of up to 64 MiB), one broadcast each: a model of hundreds of small tensors costs a
few collectives, not hundreds. Every collective runs under the group's timeout: a peer that
never joins, or dies, ends the wait with an error after at most ``timeout_s`` instead of
hanging the run.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import math
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist

BACKENDS = ("gloo",)
BUCKET_BYTES = 64 * 2**20  # one broadcast carries up to this much (a larger tensor alone)

# dtype names on the wire (SGLang sends the short names; "torch.<name>" is accepted too)
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def weights_checksum(named) -> str:
    """SHA-256 over ``(name, tensor)`` pairs in name order, each tensor's float32 bytes:
    equal on the trainer and on a server exactly when they hold the same values under the
    same names (a publication's proof of delivery, relayrl.sync.transaction)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(named, key=lambda item: item[0]):
        digest.update(name.encode())
        data = tensor.detach().to("cpu", torch.float32).contiguous()
        digest.update(data.numpy().tobytes())
    return digest.hexdigest()


def served_checksum(named, dtype: torch.dtype | None = None) -> str:
    """:func:`weights_checksum` of the tensors as a server holding its weights in ``dtype``
    holds them: each floating tensor rounded to ``dtype`` first (None: as given). The
    trainer's expected checksum of a publication and a server's checksum of what it loaded
    (``rollout.dtype=bfloat16``: fp32 weights published, bf16 held) both go through here."""
    if dtype is None:
        return weights_checksum(named)
    return weights_checksum(
        (name, tensor.to(dtype) if tensor.is_floating_point() else tensor) for name, tensor in named
    )


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``float32`` or ``torch.float32``); ValueError else."""
    dtype = DTYPES.get(name.removeprefix("torch."))
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_specs(state: Mapping[str, torch.Tensor]) -> dict[str, list]:
    """``names``, ``dtypes``, ``shapes`` of ``state`` in its order (the order of the sends)."""
    return {
        "names": list(state),
        "dtypes": [dtype_name(t.dtype) for t in state.values()],
        "shapes": [list(t.shape) for t in state.values()],
    }


def buckets(
    specs: Sequence[tuple[torch.dtype, tuple[int, ...]]], bucket_bytes: int = BUCKET_BYTES
) -> list[list[int]]:
    """Indices of ``specs`` (dtype, shape) cut into buckets sent as one flat broadcast each:
    consecutive tensors of one dtype, up to ``bucket_bytes`` (a larger tensor alone). Both
    sides compute it from the announced specs, so it is never sent."""
    out: list[list[int]] = []
    size = 0
    for i, (dtype, shape) in enumerate(specs):
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        same = out and specs[out[-1][0]][0] == dtype
        if same and size + nbytes <= bucket_bytes:
            out[-1].append(i)
            size += nbytes
        else:
            out.append([i])
            size = nbytes
    return out


def store_prefix(name: str, secret: str | None) -> str:
    """The prefix of group ``name``'s keys in the TCPStore: ``name``, plus an HMAC of it
    under ``secret`` when there is one. The store itself is unauthenticated (anyone who
    reaches its port can read and write a key whose name they know); TCPStore cannot list
    keys, so without the secret the rendezvous keys cannot be found or forged."""
    if not secret:
        return name
    tag = hmac.new(secret.encode(), b"transfer-group:" + name.encode(), hashlib.sha256)
    return f"{name}/{tag.hexdigest()[:32]}"


def listening_socket(address: str, port: int) -> int:
    """A TCP socket listening on ``address:port`` only (TCPStore alone listens on every
    interface); returns its file descriptor, which the store takes over."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock.detach()


def stop_listening(listener: socket.socket | None) -> None:
    """End a store's rendezvous: its listening socket accepts no more connections (the
    members' connections stay); an anonymous client can no longer reach the store."""
    if listener is None:
        return
    try:
        listener.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # never listened, or already shut
    listener.close()


@dataclass
class WireGroup:
    """One member (``rank``) of the transfer group ``name`` of ``world_size`` ranks. A join
    that fails, or a closed group, raises :attr:`error` (relayrl's subclass: RelayError)."""

    error: ClassVar[type[Exception]] = RuntimeError

    name: str
    rank: int
    world_size: int
    timeout_s: float
    _store: dist.Store | None = field(repr=False)
    _pg: dist.ProcessGroupGloo | None = field(repr=False)

    @classmethod
    def join(
        cls,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        name: str,
        timeout_s: float,
        secret: str | None = None,
    ) -> WireGroup:
        """Join (rank 0: host) group ``name``; blocks until all ``world_size`` ranks are in,
        :attr:`error` after ``timeout_s``. Rank 0 listens on ``master_address`` only (the
        interface the group uses), and with a ``secret`` (the trainer's, derived from the run
        key and sent to each member in its join request) the group's keys in the store live under a name derived from it
        (:func:`store_prefix`), which a process without the secret cannot guess."""
        timeout = datetime.timedelta(seconds=timeout_s)
        store: dist.TCPStore | None = None
        listener: socket.socket | None = None
        try:
            listen_fd = listening_socket(master_address, master_port) if rank == 0 else None
            if listen_fd is not None:  # a handle of our own, to stop listening once formed
                listener = socket.socket(fileno=os.dup(listen_fd))
            store = dist.TCPStore(
                master_address,
                master_port,
                world_size,
                is_master=rank == 0,
                timeout=timeout,
                wait_for_workers=False,
                **({"master_listen_fd": listen_fd} if listen_fd is not None else {}),
            )
            pg = dist.ProcessGroupGloo(
                dist.PrefixStore(store_prefix(name, secret), store), rank, world_size, timeout
            )
        except (RuntimeError, OSError, dist.DistError) as exc:
            stop_listening(listener)
            # the error's traceback keeps this frame alive: drop the store from it, so that
            # rank 0 stops listening now (see :meth:`close`), not when the error is collected
            store = None
            raise cls.error(
                f"weight-transfer group {name!r}: rank {rank} of {world_size} could not join "
                f"via {master_address}:{master_port} within {timeout_s:g}s: {exc}"
            ) from exc
        stop_listening(listener)  # formed: every member is connected, nobody else may be
        return cls(name, rank, world_size, timeout_s, store, pg)

    def _group(self) -> dist.ProcessGroupGloo:
        if self._pg is None:
            raise self.error(f"weight-transfer group {self.name!r} is closed")
        return self._pg

    def send(self, tensors: Sequence[torch.Tensor]) -> None:
        """Rank 0: broadcast every tensor, in order, to the other ranks (in buckets)."""
        group = self._group()
        specs = [(t.dtype, tuple(t.shape)) for t in tensors]
        for bucket in buckets(specs):
            flat = torch.cat([tensors[i].detach().to("cpu").reshape(-1) for i in bucket])
            group.broadcast(flat, 0).wait()

    def receive(self, specs: Sequence[tuple[str, torch.dtype, Sequence[int]]]) -> dict:
        """The other ranks: receive one tensor per ``(name, dtype, shape)``, in order."""
        group = self._group()
        state: dict[str, torch.Tensor] = {}
        for bucket in buckets([(dtype, tuple(shape)) for _, dtype, shape in specs]):
            sizes = [math.prod(specs[i][2]) for i in bucket]
            flat = torch.empty(sum(sizes), dtype=specs[bucket[0]][1])
            group.broadcast(flat, 0).wait()
            for i, part in zip(bucket, flat.split(sizes), strict=True):
                state[specs[i][0]] = part.view(tuple(specs[i][2]))
        return state

    def close(self) -> None:
        """Leave the group: a collective still waiting on any rank ends with an error, and
        rank 0's store stops listening. A group left (or never formed) must not keep its
        rendezvous open: a member that joins it late (a server that was stopped while the
        group formed, answering the stale request once resumed) would read the departed
        ranks' addresses there and wait in gloo's connect for about five times ``timeout_s``
        (30 s at 6 s), where a closed store fails its connect retries instead."""
        pg, self._pg, self._store = self._pg, None, None
        if pg is not None:
            try:
                pg.abort()
            except RuntimeError:
                pass
