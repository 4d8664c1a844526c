"""A LoRA adapter as a standard PEFT directory (docs/lora.md "vLLM"), written by relayrl (an
adapter publication, ``relayrl.engine.adapter.write_peft_dir``) and by the vLLM worker
extension (the zero "base" adapter a server names before the first publication). Imports the
standard library, torch and safetensors only (a dependency of both environments).

Owns: :func:`write_peft` (``adapter_config.json`` and ``adapter_model.safetensors`` as
``peft.PeftModel.save_pretrained`` writes them; ``lora_alpha`` is ``scale · r``, so a
loader's ``lora_alpha / r`` is the scale).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

PEFT_PREFIX = "base_model.model."  # peft's prefix of the base model's module names


def write_peft(
    pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]], scale: float, directory: Path
) -> Path:
    """Write the adapter ``pairs`` (module name -> (A: r × in, B: out × r)) with ``scale``
    as a PEFT LoRA directory ``directory``, whole or not at all (written beside it, then
    renamed). ValueError when the modules' ranks differ (one ``r`` per directory)."""
    from safetensors.torch import save_file

    ranks = {a.shape[0] for a, _ in pairs.values()}
    if len(ranks) != 1:
        raise ValueError(
            f"an adapter's modules must share one rank to be a PEFT directory: {ranks}"
        )
    rank = ranks.pop()
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": float(scale) * rank,
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in pairs}),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "task_type": None,
        "inference_mode": True,
    }
    tensors: dict[str, torch.Tensor] = {}
    for module, (a, b) in pairs.items():
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.detach().to("cpu").contiguous()
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b.detach().to("cpu").contiguous()
    tmp = directory.with_name(directory.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    tmp.replace(directory)
    return directory
