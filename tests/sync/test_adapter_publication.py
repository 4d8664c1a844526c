"""Adapter-only publications (``model.lora``, relayrl.engine.adapter, docs/lora.md): the merge
is W_base + scale·B·A to float rounding and the same bits at any thread count; a built-in
engine that loads adapter after adapter serves exactly base + the newest adapter (its
checksum equals the one the trainer recorded), keeps its base weights untouched (their
checksum before == after), and is back at the base for a zero adapter; a bad adapter is
refused before any weight changes. Through the publication transaction on a real server,
adapter publications pass verify and the canary, and a server that takes the adapter but
does not apply it fails the verify step naming the server and the version, with the disk and
the broadcast transport. By broadcast only the adapter tensors travel (two servers; a zero
adapter last gives back the base bit for bit), a misfit adapter is refused before anything is
received, and a broadcast-only publication is written as an adapter snapshot on demand."""

from __future__ import annotations

import asyncio

import pytest
import torch

from relayrl.config.schema import LoraConfig, TrainConfig
from relayrl.engine.adapter import Adapter, merge_weight, read_adapter, write_adapter
from relayrl.engine.engine import Engine
from relayrl.engine.model_runner import ModelRunner
from relayrl.engine.types import EngineOptions
from relayrl.errors import RelayError
from relayrl.launch.servers import ServerLauncher, ServerSpec
from relayrl.launch.supervisor import ServerSupervisor
from relayrl.models.loading import load_model, load_tokenizer
from relayrl.sync.canary import Canary
from relayrl.sync.transaction import PublicationError
from relayrl.sync.transports import make_publisher
from relayrl.sync.weight_sync import WeightSync
from relayrl.train.lora import adapter_snapshot, apply_lora, save_adapter_snapshot
from tests.sync.test_publication import Listener


class LoraSource:
    """A LoRA policy with random (non-zero) B matrices, published as the trainer does."""

    def __init__(self, model_dir, seed: int | None) -> None:
        self.model = apply_lora(load_model(model_dir), LoraConfig(r=4, alpha=8.0))
        if seed is not None:
            generator = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    if ".lora_B." in name:
                        p.copy_(0.3 * torch.randn(p.shape, generator=generator))

    def save_weights(self, directory):
        return save_adapter_snapshot(self.model, directory)

    def lora_adapter(self):
        return adapter_snapshot(self.model)


def test_merge_is_base_plus_scaled_product_and_thread_independent():
    g = torch.Generator().manual_seed(0)
    base, a, b = (torch.randn(s, generator=g) for s in ((48, 40), (8, 40), (48, 8)))
    expected = base.double() + 0.5 * (b.double() @ a.double())
    merged = merge_weight(base, a, b, 0.5)
    assert merged.dtype == torch.float32
    torch.testing.assert_close(merged.double(), expected, rtol=0, atol=1e-5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        again = merge_weight(base, a, b, 0.5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(merged, again)


def test_engine_serves_base_plus_newest_adapter_and_keeps_the_base(tiny_model_dir, tmp_path):
    model = load_model(tiny_model_dir)
    options = EngineOptions(max_seq_len=128)
    with Engine(model, load_tokenizer(tiny_model_dir), options) as engine:
        base = engine.weights_checksum()

        def base_checksum():
            return engine._call(engine.adapter_base.base_checksum, engine.runner.model)

        for seed in (1, 2):  # the second replaces the first (no accumulation)
            snapshot = LoraSource(tiny_model_dir, seed).save_weights(tmp_path / f"v{seed}")
            adapter = read_adapter(snapshot)
            assert engine.update_weights(snapshot, version=seed) == seed
            assert engine.weights_checksum() == adapter.checksum != base
            assert base_checksum() == base
        a, b = adapter.pairs["model.layers.0.self_attn.q_proj"]
        served = dict(engine.runner.model.named_parameters())
        original = dict(load_model(tiny_model_dir).named_parameters())
        name = "model.layers.0.self_attn.q_proj.weight"
        expected = original[name].double() + adapter.scale * (b.double() @ a.double())
        torch.testing.assert_close(served[name].double(), expected, rtol=0, atol=1e-5)
        zero = LoraSource(tiny_model_dir, None).save_weights(tmp_path / "v3")  # B = 0
        engine.update_weights(zero, version=3)
        assert engine.weights_checksum() == base

        bad = Adapter({"model.layers.0.self_attn.q_proj": (a[:, :-1], b)}, 1.0)
        write_adapter(bad, tmp_path / "bad")
        before = engine.weights_checksum()
        try:
            engine.update_weights(tmp_path / "bad", version=4)
            raise AssertionError("a misfit adapter was loaded")
        except RelayError as exc:
            assert "do not fit the weight" in str(exc)
        assert engine.weights_checksum() == before


def publish(tiny_model_dir, tmp_path, listener, transport="disk", servers=1, seeds=(1, 2)):
    """Publish a LoRA source per seed (None: B = 0) as versions 1, 2, ... through the
    publication transaction (verify and canary on every one) to built-in servers; returns
    the canary count and largest difference, the servers' checksums at the end and the
    publisher's counters, and the servers' URLs."""
    launcher = ServerLauncher(ServerSpec(str(tiny_model_dir)), servers, "thread", log_dir=tmp_path)
    train = TrainConfig(weight_transport=transport, broadcast_timeout_s=30)
    publisher = make_publisher(train)

    async def main(urls):
        from relayrl.engine.client import RolloutClient

        async with RolloutClient(urls, timeout=60) as client:
            supervisor = ServerSupervisor(launcher, client, 0)
            publication = WeightSync(
                supervisor, publisher, tmp_path / "w", listener, Canary(every=1, tolerance=1e-4)
            )
            for version, seed in enumerate(seeds, start=1):
                await publication.submit(LoraSource(tiny_model_dir, seed), version, wait=True)
                if listener.failure is not None:
                    break
            sums = [c["checksum"] for c in await client.weights_checksum()]
            publisher.close()
            return publication.canaries, publication.canary_max_diff, sums, publisher.stats()

    with launcher:
        return asyncio.run(main(launcher.urls)), launcher.urls


def test_adapter_publications_pass_verify_and_canary(tiny_model_dir, tmp_path):
    listener = Listener()
    (canaries, max_diff, _, _), _ = publish(tiny_model_dir, tmp_path, listener)
    assert listener.failure is None and listener.versions == [1, 2]
    assert canaries == 2 and max_diff < 1e-4, max_diff


def test_adapter_broadcast_sends_only_the_adapters_and_keeps_the_base(
    tiny_model_dir, tmp_path, monkeypatch
):
    """``train.weight_transport=broadcast`` under LoRA, two built-in servers: each
    publication broadcasts only the ``lora_A`` / ``lora_B`` tensors (with the scale), the
    servers merge them into their copy exactly (verify: the merged weights' checksum the
    trainer recorded; the canary), and a zero adapter after two others gives back the base
    bit for bit: the base weights were never overwritten."""
    from relayrl.engine.client import RolloutClient
    from relayrl.engine.weights import weights_checksum

    sent: list[dict] = []
    real = RolloutClient.update_weights_from_distributed

    async def spy(self, url, body):
        sent.append(body)
        return await real(self, url, body)

    monkeypatch.setattr(RolloutClient, "update_weights_from_distributed", spy)
    listener = Listener()
    (canaries, max_diff, sums, stats), urls = publish(
        tiny_model_dir, tmp_path, listener, "broadcast", servers=2, seeds=(1, 2, None)
    )
    assert listener.failure is None and listener.versions == [1, 2, 3]
    assert canaries == 3 and max_diff < 1e-4, max_diff
    assert len(sent) == 3 * len(urls)  # every publication by broadcast, to every server
    assert stats["broadcast_fallbacks"] == 0 and stats["transfer_groups"] == 1
    adapter = LoraSource(tiny_model_dir, 1).lora_adapter()
    for body in sent:
        assert body["names"] == list(adapter.tensors()) and body["lora_scale"] == adapter.scale
    full = sum(p.numel() for p in load_model(tiny_model_dir).parameters())
    moved = sum(t.numel() for t in adapter.tensors().values())
    assert moved < 0.1 * full  # rank 4 on every linear layer of the tiny model
    base = weights_checksum(load_model(tiny_model_dir).named_parameters())
    assert sums == [base, base]  # v3 is a zero adapter: the untouched base is served


def test_a_misfit_broadcast_adapter_is_refused_before_anything_is_received(tiny_model_dir):
    """The server checks an adapter's names and shapes against its model before it joins
    the broadcast (a 400 naming the module), as it does for full weights."""
    from fastapi.testclient import TestClient

    from relayrl.engine.server import create_app

    body = {
        "names": [
            "model.layers.0.self_attn.q_proj.lora_A",
            "model.layers.0.self_attn.q_proj.lora_B",
        ],
        "dtypes": ["float32", "float32"],
        "shapes": [[4, 127], [128, 4]],
        "group_name": "relayrl-w1",
        "lora_scale": 2.0,
    }
    model = load_model(tiny_model_dir)
    with Engine(model, load_tokenizer(tiny_model_dir), EngineOptions(max_seq_len=128)) as engine:
        client = TestClient(create_app(engine))
        answer = client.post("/update_weights_from_distributed", json=body)
        assert answer.status_code == 400
        assert "do not fit the weight" in answer.json()["error"], answer.json()
        unpaired = {**body, "names": body["names"][:1], "dtypes": ["float32"], "shapes": [[4, 128]]}
        answer = client.post("/update_weights_from_distributed", json=unpaired)
        assert answer.status_code == 400 and "every module needs exactly" in answer.json()["error"]


@pytest.mark.parametrize("transport", ["disk", "broadcast"])
def test_an_adapter_not_applied_on_the_server_fails_verification(
    tiny_model_dir, tmp_path, monkeypatch, transport
):
    monkeypatch.setattr(ModelRunner, "load_adapter", lambda self, state: None)
    listener = Listener()
    _, urls = publish(tiny_model_dir, tmp_path, listener, transport)
    assert listener.versions == []
    error = listener.failure
    assert isinstance(error, PublicationError) and error.step == "verify", error
    assert error.version == 1 and error.servers == urls
    assert "stale or partial weights under the new label" in str(error)


def test_a_broadcast_adapter_publication_without_a_disk_snapshot_is_written_on_demand(
    tiny_model_dir, tmp_path
):
    """With ``broadcast_snapshot_every=2`` the second publication is broadcast only; when a
    server must restart (or a broadcast falls back to disk) the held adapters are written
    then, as an adapter snapshot with the trainer's checksum, not as full weights."""
    from relayrl.sync.transports import BroadcastPublisher

    publisher = BroadcastPublisher(30.0, snapshot_every=2)
    source = LoraSource(tiny_model_dir, 1)
    first = publisher.snapshot(source, tmp_path, 1)
    assert first.path == tmp_path / "v1" and read_adapter(first.path).checksum
    with torch.no_grad():  # the trainer trains on: the held copy must not follow
        second = publisher.snapshot(source, tmp_path, 2)
        for name, p in source.model.named_parameters():
            if ".lora_B." in name:
                p.add_(1.0)
    assert second.path is None and second.adapter is not None
    assert list(second.state) == list(second.adapter.tensors())
    path = publisher.restart_snapshot(second)
    written = read_adapter(path)
    assert path == tmp_path / "v2" and written.checksum == second.adapter.checksum
    live = source.lora_adapter()
    assert written.checksum != live.checksum  # the live adapters moved on, the held did not
    module = "model.layers.0.self_attn.q_proj"
    torch.testing.assert_close(
        live.pairs[module][1] - written.pairs[module][1], torch.ones_like(live.pairs[module][1])
    )
    for module, (a, b) in second.adapter.pairs.items():
        assert torch.equal(written.pairs[module][0], a)
        assert torch.equal(written.pairs[module][1], b)
