"""The final model's PEFT adapter names its base model by an absolute path, so that it loads
with peft from any working directory (issue 44 item 6: ``model.path=my_model`` was stored
as written, relative to the run's directory)."""

from __future__ import annotations

import json
import shutil

import torch
from peft import AutoPeftModelForCausalLM
from transformers import AutoModelForCausalLM

from relayrl.config.schema import LoraConfig
from relayrl.models.loading import load_model
from relayrl.train.lora import apply_lora, save_model


def test_the_adapter_loads_with_peft_from_another_directory(tmp_path, tiny_model_dir, monkeypatch):
    shutil.copytree(tiny_model_dir, tmp_path / "my_model")
    monkeypatch.chdir(tmp_path)
    model = apply_lora(load_model("my_model"), LoraConfig(r=4), seed=0)
    with torch.no_grad():  # adapters that change the output, so loading them is visible
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.fill_(0.01)
    save_model(model, tmp_path / "out")
    adapter = tmp_path / "out" / "adapter"
    saved = json.loads((adapter / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(tmp_path / "my_model")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    loaded = AutoPeftModelForCausalLM.from_pretrained(str(adapter)).merge_and_unload()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for (name, a), (_, b) in zip(
        loaded.state_dict().items(), merged.state_dict().items(), strict=True
    ):
        assert torch.allclose(a, b, atol=1e-6), name
