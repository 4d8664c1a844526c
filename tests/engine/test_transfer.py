"""The weight-transfer group (``relayrl.engine.transfer``) in one process: bucket layout by
hand, a broadcast round trip of mixed dtypes that leaves torch.distributed's default group
alone (and works beside one), a join that no peer answers failing within its timeout, a group
that failed to form or was left no longer listening on rank 0 (a server that answers the stale
join late must fail at the store, not wait in gloo), dtype names, and the config that takes the
broadcast transport for either engine."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from relayrl.config.loader import load_config
from relayrl.engine.transfer import TransferGroup, buckets, dtype_from_name, tensor_specs
from relayrl.errors import RelayError
from relayrl.launch.servers import free_port

F32, BF16 = torch.float32, torch.bfloat16
SPECS = [(F32, (2, 3)), (F32, (4,)), (BF16, (5,)), (F32, (1,)), (F32, (100,))]


def test_buckets_group_consecutive_same_dtype_tensors_under_the_byte_limit():
    # bytes: 24, 16, 10 (bf16), 4, 400
    assert buckets(SPECS, bucket_bytes=64) == [[0, 1], [2], [3], [4]]
    assert buckets(SPECS, bucket_bytes=32) == [[0], [1], [2], [3], [4]]
    assert buckets(SPECS, bucket_bytes=10**6) == [[0, 1], [2], [3, 4]]
    assert buckets([], bucket_bytes=64) == []


def test_dtype_names_accept_short_and_torch_forms():
    assert dtype_from_name("bfloat16") is BF16 and dtype_from_name("torch.float32") is F32
    with pytest.raises(ValueError, match="unknown dtype 'float99'"):
        dtype_from_name("float99")


def test_broadcast_round_trip_of_mixed_dtypes_leaves_the_default_group_alone():
    generator = torch.Generator().manual_seed(0)
    state = {
        f"t{i}": torch.randn(shape, generator=generator).to(dtype)
        for i, (dtype, shape) in enumerate(SPECS)
    }
    specs = tensor_specs(state)
    port, received, errors = free_port(), {}, []

    def receiver() -> None:
        try:
            group = TransferGroup.join("127.0.0.1", port, 1, 2, "relayrl-w1", 20.0)
            wanted = zip(specs["names"], specs["dtypes"], specs["shapes"], strict=True)
            received.update(group.receive([(n, getattr(torch, d), s) for n, d, s in wanted]))
            group.close()
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    thread = threading.Thread(target=receiver)
    thread.start()
    sender = TransferGroup.join("127.0.0.1", port, 0, 2, "relayrl-w1", 20.0)
    sender.send(list(state.values()))
    thread.join(30)
    sender.close()
    assert not errors, errors
    assert list(received) == list(state)
    for name, tensor in state.items():
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor)
    assert not dist.is_initialized()  # no default group was created or touched


def test_a_join_no_peer_answers_fails_within_its_timeout():
    start = time.monotonic()
    with pytest.raises(RelayError, match=r"'relayrl-w7': rank 0 of 2 could not join .* 1s"):
        TransferGroup.join("127.0.0.1", free_port(), 0, 2, "relayrl-w7", 1.0)
    assert time.monotonic() - start < 10


def listening(port: int) -> bool:
    """Whether anything accepts TCP connections on 127.0.0.1:``port``."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return False
    return True


def test_a_group_that_failed_to_form_or_was_left_no_longer_listens():
    """Rank 0's store is released the moment its group fails to form (even while the error,
    whose traceback holds the join's frame, is kept, as a failed publication keeps it) or is
    left: a server that answers the abandoned group's join late then fails at the store within
    its timeout, instead of reading the departed ranks' addresses there and waiting in gloo's
    connect for several times the timeout (which held the server's next join past its
    deadline: tests/sync/test_broadcast.py)."""
    port = free_port()
    with pytest.raises(RelayError, match="rank 0 of 2 could not join") as failure:
        TransferGroup.join("127.0.0.1", port, 0, 2, "relayrl-w1", 1.0)
    assert failure.value.__traceback__ is not None and not listening(port)

    port, joined = free_port(), {}
    thread = threading.Thread(
        target=lambda: joined.update(m=TransferGroup.join("127.0.0.1", port, 1, 2, "w2", 20.0))
    )
    thread.start()
    host = TransferGroup.join("127.0.0.1", port, 0, 2, "w2", 20.0)
    thread.join(30)
    assert not listening(port)  # formed: the store takes no new connection (security.md)
    host.close()
    joined["m"].close()
    assert not listening(port)


def test_broadcast_transport_is_accepted_for_both_engines():
    for engine in ("builtin", "vllm"):
        config = load_config(None, [f"rollout.engine={engine}", "train.weight_transport=broadcast"])
        assert config.train.weight_transport == "broadcast" and config.rollout.engine == engine


def test_a_transfer_group_beside_a_default_group_leaves_it_working():
    """An FSDP trainer has a default group of its own: the transfer group must neither need
    nor disturb it (one rank here; the default group's all-reduce works before and after)."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        port, received = free_port(), {}
        thread = threading.Thread(
            target=lambda: received.update(
                TransferGroup.join("127.0.0.1", port, 1, 2, "relayrl-w1", 20.0).receive(
                    [("w", F32, (3,))]
                )
            )
        )
        thread.start()
        sender = TransferGroup.join("127.0.0.1", port, 0, 2, "relayrl-w1", 20.0)
        sender.send([torch.tensor([1.0, 2.0, 3.0])])
        thread.join(30)
        sender.close()
        total = torch.tensor([5.0])
        dist.all_reduce(total)  # the default group: world size 1, untouched
        assert dist.get_world_size() == 1 and total.item() == 5.0
        assert torch.equal(received["w"], torch.tensor([1.0, 2.0, 3.0]))
    finally:
        dist.destroy_process_group()
