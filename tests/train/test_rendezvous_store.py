"""The trainer ranks' rendezvous store (``train.world_size`` > 1) is on loopback, keyed by a
secret, and open only while the group forms (docs/security.md).

Before: ``init_process_group(init_method="tcp://127.0.0.1:PORT")`` made a TCPStore that
listened on every interface (``*:PORT``) for the whole run and took anyone's keys (an
anonymous client stored 400 MiB in it)."""

from __future__ import annotations

import datetime
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from relayrl.engine.wire.relayrl_transfer_wire import store_prefix
from relayrl.launch.servers import free_port
from tests.launch.test_control_plane_auth import listening_addresses

ROOT = Path(__file__).resolve().parents[2]


def anonymous_client(port: int, timeout_s: float = 3.0) -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


def test_the_ranks_store_is_on_loopback_and_its_keys_need_the_secret():
    from relayrl.train.distributed import RENDEZVOUS_GROUP, rendezvous_store

    port = free_port()
    rendezvous = rendezvous_store("127.0.0.1", port, 0, 2, "the-secret", 10.0)
    try:
        assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1 only, not *:PORT
        rendezvous.store.set("rank_1_address", "10.0.0.1")
        stranger = anonymous_client(port)
        assert not stranger.check(["rank_1_address"])  # cannot read the ranks' keys
        stranger.set("rank_1_address", "6.6.6.6")  # nor overwrite them
        assert rendezvous.store.get("rank_1_address") == b"10.0.0.1"
        guess = dist.PrefixStore(store_prefix(RENDEZVOUS_GROUP, "a-guess"), stranger)
        assert not guess.check(["rank_1_address"])
        member = dist.PrefixStore(store_prefix(RENDEZVOUS_GROUP, "the-secret"), stranger)
        assert member.get("rank_1_address") == b"10.0.0.1"  # what the secret opens
        rendezvous.close()  # formed: no more connections
        assert listening_addresses(port) == set()
        with pytest.raises(dist.DistError):
            anonymous_client(port, timeout_s=1.0)
    finally:
        rendezvous.close()


FORM = """
import sys, torch
from pathlib import Path
from relayrl.models.loading import load_model, load_tokenizer
from relayrl.train.distributed import make_trainer
from tests.train.conftest import rl_config
model_dir, run_dir, port = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
run_dir.mkdir(parents=True)
config = rl_config(run_dir.parent, model_dir, "train.world_size=2", f"train.master_port={port}",
                   "train.trainer_threads=1", "train.dist_timeout_s=60")
trainer = make_trainer(load_model(model_dir), config, load_tokenizer(model_dir).pad_token_id,
                       Path(model_dir), run_dir)
print("formed", flush=True)
sys.stdin.readline()
trainer.close()
"""


def _wait_for(proc: subprocess.Popen, word: str, timeout_s: float) -> str:
    """The process's output up to the line ``word`` (or to its end or the deadline)."""
    deadline, seen = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            line = proc.stdout.readline()
            seen += line
            if line.strip() == word:
                break
    return seen


def test_formed_trainer_ranks_accept_no_new_client(tiny_model_dir, tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", FORM, str(tiny_model_dir), str(tmp_path / "run"), str(port)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=env, cwd=ROOT,
    )  # fmt: skip
    try:
        seen = _wait_for(proc, "formed", 180.0)
        assert seen.endswith("formed\n"), seen
        assert not listening_addresses(port) - {"0100007F"}  # never *:PORT
        with pytest.raises(dist.DistError):  # the store is closed to newcomers
            anonymous_client(port, timeout_s=1.0).set("junk", "x" * 1024)
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(60) == 0
    finally:
        proc.kill()
        proc.wait()
    log = (tmp_path / "run" / "trainer-rank1.log").read_text()
    assert "ready" in log and json.dumps(str(port)) not in log


def test_the_weight_transfer_store_closes_once_its_group_formed():
    """The broadcast transport's store: open while its group forms, closed after (it took
    anonymous set/get for the whole run); the formed group still broadcasts."""
    import threading

    import torch

    from relayrl.engine.transfer import TransferGroup

    port = free_port()
    groups: dict[int, TransferGroup] = {}

    def join(rank: int) -> None:
        groups[rank] = TransferGroup.join("127.0.0.1", port, rank, 2, "g", 20.0, "run-secret")

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    try:
        assert set(groups) == {0, 1}
        assert listening_addresses(port) == set()
        with pytest.raises(dist.DistError):
            anonymous_client(port, timeout_s=1.0)
        sent = [torch.arange(6, dtype=torch.float32).reshape(2, 3)]
        sender = threading.Thread(target=groups[0].send, args=(sent,))
        sender.start()
        got = groups[1].receive([("w", torch.float32, [2, 3])])
        sender.join(30)
        assert torch.equal(got["w"], sent[0])
    finally:
        for group in groups.values():
            group.close()
