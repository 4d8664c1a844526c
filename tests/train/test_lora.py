"""LoRA training end to end (``model.lora``, docs/lora.md): a `relayrl train` run publishes
adapter-only snapshots that the built-in engine merges exactly (η = 0: the engine's
behaviour logprobs equal the trainer's recompute to float rounding, every publication's
merged-weights checksum verified and its canary passed), at η = 2 too; a crash and
``--resume`` from a checkpoint ends with the uninterrupted run's weights (bitwise); SFT with
LoRA changes only the adapted layers, by a rank-r update; unsupported combinations are
refused naming the keys."""

from __future__ import annotations

import json

import pytest
import torch

from relayrl.config.loader import load_config
from relayrl.errors import RelayError
from relayrl.models.loading import load_model
from relayrl.train.run import run_train
from tests.train.conftest import parity_grader, rl_config
from tests.train.test_resume import crash_on_call, rows, sample_keys

LORA = ("model.lora.r=8", "model.lora.alpha=16")
# engine_trainer_kl_k3 with LoRA at η = 0: 4e-14 to 5e-14 measured (2-core CPU, 2026-11-25),
# as with full fine-tuning (the merge is exact; the trainer's LoRA forward rounds differently)
MAX_MEAN_K3 = 1e-8


def steps_of(run_dir):
    return [r for r in rows(run_dir / "metrics.jsonl") if not r.get("final")]


def test_lora_run_publishes_adapters_the_engine_serves_exactly(tmp_path, tiny_model_dir):
    config = rl_config(
        tmp_path, tiny_model_dir, *LORA, "rollout.eta=0", "train.publish_canary_every=1"
    )
    result = run_train(config, grader=parity_grader)
    run = tmp_path / "run"
    steps = steps_of(run)
    assert [r["step"] for r in steps] == [1, 2, 3]
    kl = [r["engine_trainer_kl_k3"] for r in steps]
    print(f"engine_trainer_kl_k3 per step (LoRA, η = 0): {kl}")
    assert all(k < MAX_MEAN_K3 for k in kl), kl
    assert steps[0]["grad_norm"] > 0  # the adapters did train
    assert result.summary["publications"] == 2
    assert result.summary["publish_canaries"] == 2
    assert result.summary["publish_canary_max_logprob_diff"] < 1e-4
    # the final model: merged, with the standard PEFT adapter directory beside it
    final = run / "final_model"
    adapter_dir = final / "adapter"
    assert (adapter_dir / "adapter_config.json").is_file()
    assert (adapter_dir / "adapter_model.safetensors").is_file()
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["r"] == 8
    from peft import PeftModel

    peft_merged = PeftModel.from_pretrained(load_model(tiny_model_dir), adapter_dir)
    peft_merged = dict(peft_merged.merge_and_unload().named_parameters())
    base = dict(load_model(tiny_model_dir).named_parameters())
    moved = 0.0
    for name, p in load_model(final).named_parameters():
        torch.testing.assert_close(p, peft_merged[name], rtol=0, atol=1e-6)
        moved = max(moved, (p - base[name]).abs().max().item())
        if "proj" not in name:  # embeddings and norms are not adapted: untouched
            assert torch.equal(p, base[name]), name
    assert moved > 1e-5


def test_lora_run_at_eta_2(tmp_path, tiny_model_dir):
    config = rl_config(tmp_path, tiny_model_dir, *LORA, "rollout.eta=2", "train.total_steps=3")
    result = run_train(config, grader=parity_grader)
    steps = steps_of(tmp_path / "run")
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["staleness_max"] <= 2 for r in steps)
    kl = [r["engine_trainer_kl_k3"] for r in steps if "engine_trainer_kl_k3" in r]
    print(f"engine_trainer_kl_k3 (LoRA, η = 2, steps with fresh tokens): {kl}")
    assert all(k < MAX_MEAN_K3 for k in kl), kl
    assert result.summary["publications"] >= 1


# the resume must load the checkpoint, not drop it as unusable and start over (which ends
# with the same weights at η = 0 too): a LoRA checkpoint's model/ has no config.json
@pytest.mark.filterwarnings("error::relayrl.train.checkpoint.CheckpointWarning")
def test_lora_crash_and_resume_equals_uninterrupted(tmp_path, tiny_model_dir, monkeypatch):
    common = (*LORA, "rollout.eta=0", "train.total_steps=3", "rollout.max_running_requests=1")
    run_train(rl_config(tmp_path / "a", tiny_model_dir, *common), grader=parity_grader)
    cut = rl_config(tmp_path / "b", tiny_model_dir, *common, "train.checkpoint_every=2")
    crash_on_call(monkeypatch, 3)  # step 3 crashes; the checkpoint after step 2 survives
    with pytest.raises(RuntimeError, match="injected crash"):
        run_train(cut, grader=parity_grader)
    monkeypatch.undo()
    run_dir = tmp_path / "b" / "run"
    checkpoint = next(run_dir.glob("checkpoints/step-*"))
    assert (checkpoint / "model" / "adapter_model.safetensors").is_file()  # the adapter only
    assert not (checkpoint / "model" / "model.safetensors").exists()
    run_train(cut, grader=parity_grader, resume=True)
    a_dir = tmp_path / "a" / "run"
    assert sample_keys(run_dir) == sample_keys(a_dir)
    a = dict(load_model(a_dir / "final_model").named_parameters())
    for name, p in load_model(run_dir / "final_model").named_parameters():
        assert torch.equal(p, a[name]), name  # bitwise


@pytest.mark.parametrize("world_size", [1, 2])
def test_lora_run_with_broadcast_publication(tmp_path, tiny_model_dir, world_size):
    """``train.weight_transport=broadcast`` with two built-in servers, at world size 1 and 2
    (the adapters gathered on rank 0): every publication is broadcast (no disk fallback),
    verified against the merged weights' checksum, and passes the canary; at η = 0 the
    engine's logprobs are the trainer's to float rounding."""
    config = rl_config(
        tmp_path,
        tiny_model_dir,
        *LORA,
        "rollout.eta=0",
        "rollout.num_servers=2",
        "train.weight_transport=broadcast",
        "train.broadcast_snapshot_every=2",
        "train.broadcast_timeout_s=30",
        "train.publish_canary_every=1",
        f"train.world_size={world_size}",
    )
    result = run_train(config, grader=parity_grader)
    steps = steps_of(tmp_path / "run")
    assert [r["step"] for r in steps] == [1, 2, 3]
    kl = [r["engine_trainer_kl_k3"] for r in steps]
    print(f"engine_trainer_kl_k3 per step (LoRA, broadcast, world size {world_size}): {kl}")
    assert all(k < MAX_MEAN_K3 for k in kl), kl
    summary = result.summary
    assert summary["weight_transport"] == "broadcast" and summary["publications"] == 2
    assert summary["transfer_groups"] == 1 and summary["broadcast_fallbacks"] == 0
    assert summary["disk_snapshots"] == 1  # v1 also on disk (the restart source), v2 not
    assert summary["publish_canaries"] == 2
    assert summary["publish_canary_max_logprob_diff"] < 1e-4
    assert steps[0]["grad_norm"] > 0


def test_sft_with_lora_changes_only_adapted_layers_by_rank_r(tmp_path):
    from relayrl.train.sft import run_sft

    config = load_config(
        None,
        [
            f"output_dir={tmp_path}",
            "name=sft",
            "model.preset=tiny",
            "model.lora.r=4",
            "model.lora.target_modules=[q_proj,v_proj]",
            "sft.steps=20",
            "sft.batch_size=8",
            "sft.lr=1e-2",
            "eval.num_problems=4",
            "eval.max_new_tokens=8",
            "runtime.threads=1",
        ],
    )
    run_sft(config, progress=False)
    run = tmp_path / "sft"
    base = dict(load_model(run / "base_model").named_parameters())
    tuned = dict(load_model(run / "sft_model").named_parameters())
    assert (run / "sft_model" / "adapter" / "adapter_model.safetensors").is_file()
    adapted = [n for n in base if n.endswith(("q_proj.weight", "v_proj.weight"))]
    assert adapted
    for name, p in tuned.items():
        if name in adapted:
            delta = (p - base[name]).double()
            assert delta.abs().max() > 0, name
            assert torch.linalg.matrix_rank(delta, atol=1e-5).item() <= 4, name
        else:
            assert torch.equal(p, base[name]), name


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("rollout.lag=fixed", "rollout.lag"),
    ],
)
def test_unsupported_lora_combinations_are_refused_naming_the_key(override, key):
    with pytest.raises(RelayError, match=f"model.lora is not supported with {key}="):
        load_config(None, [*LORA, override])
