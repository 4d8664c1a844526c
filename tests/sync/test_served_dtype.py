"""``rollout.dtype``: servers in another dtype than the trainer (bf16 generation, fp32
training). A publication is verified by the checksum of what such a server holds after
loading the trainer's fp32 tensors, i.e. of those tensors rounded to its dtype; the
trainer's bf16 autocast (``train.mixed_precision=bf16`` at world size 1) keeps fp32
weights and gives logprobs within bf16 rounding of fp32's."""

from __future__ import annotations

import pytest
import torch

from relayrl.config.loader import load_config
from relayrl.engine.weights import load_into, model_checksum, served_checksum
from relayrl.errors import RelayError
from relayrl.models.loading import load_model
from relayrl.sync.transaction import snapshot_checksum
from relayrl.sync.transports import Snapshot
from relayrl.train.options import TrainerOptions
from tests.buffer.test_replay_training import make_trainer, synthetic_groups


def test_the_checksum_of_a_bf16_server_is_of_the_rounded_weights(tiny_model_dir):
    trainer_model = load_model(tiny_model_dir)
    with torch.no_grad():  # a trained step away from the server's copy
        for p in trainer_model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    state = {n: p.detach().clone() for n, p in trainer_model.named_parameters()}
    server = load_model(tiny_model_dir, dtype="bfloat16")
    load_into(server, state)
    snapshot = Snapshot(version=1, state=state)
    assert snapshot_checksum(snapshot, torch.bfloat16) == model_checksum(server)
    # the rule a vLLM server applies to the fp32 tensors it is given (relayrl_vllm_ext)
    assert served_checksum(state.items(), torch.bfloat16) == model_checksum(server)
    assert snapshot_checksum(snapshot) != model_checksum(server)  # fp32's would fail
    assert snapshot_checksum(snapshot) == model_checksum(trainer_model)


def test_rollout_dtype_in_the_config():
    config = load_config(None, ["rollout.dtype=bfloat16"])
    assert config.served_dtype == "bfloat16" and config.model.dtype == "float32"
    assert load_config(None, []).served_dtype == "float32"
    with pytest.raises(RelayError, match="model.lora is not supported with rollout.dtype"):
        load_config(None, ["rollout.dtype=bfloat16", "model.lora.r=4"])


def test_bf16_autocast_at_world_size_1(tiny_model_dir):
    """The trainer's logprobs under autocast are bf16-rounded fp32 ones; the weights and the
    step's update stay fp32."""
    options = TrainerOptions.from_config(load_config(None, ["train.mixed_precision=bf16"]))
    assert options.autocast_bf16
    wide = load_config(None, ["train.mixed_precision=bf16", "train.world_size=2"])
    assert not TrainerOptions.from_config(wide).autocast_bf16  # FSDP2's own policy there
    fp32 = make_trainer(tiny_model_dir)
    bf16 = make_trainer(tiny_model_dir, "train.mixed_precision=bf16")
    groups = synthetic_groups(fp32, seed=0, lags=[0, 0])
    trajs = [t for g in groups for t in g]
    exact, rounded = fp32.traj_logprobs(fp32.model, trajs), bf16.traj_logprobs(bf16.model, trajs)
    gap = max(float((a - b).abs().max()) for a, b in zip(exact, rounded, strict=True))
    assert 0 < gap < 0.1
    bf16.train_step(groups)
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
