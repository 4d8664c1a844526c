"""bf16 where it is fast, float32 where it is emulated: the recipe's ``auto`` precision
resolves by the CPU at load, and explicit bf16 on a CPU that emulates it warns, naming the
overrides that make it fast (on an AVX2-only EPYC, `relayrl eval` of the recipe took 3.7x as
long in bf16 as in float32: docs/real-model.md)."""

from __future__ import annotations

import pytest
import torch

from relayrl.config.loader import load_config
from relayrl.config.schema import RunConfig
from relayrl.models.precision import bf16_is_fast, cpu_has_fast_bf16
from relayrl.train.run.start import slow_bf16_warning

RECIPE = "configs/smollm2.yaml"
EXPLICIT_BF16 = ["rollout.dtype=bfloat16", "train.mixed_precision=bf16"]


def recipe(monkeypatch, fast: bool, *overrides: str) -> RunConfig:
    monkeypatch.setattr("relayrl.config.schema.bf16_is_fast", lambda device: fast)
    return load_config(RECIPE, list(overrides), resolve_model=False)


@pytest.mark.parametrize(
    "fast, served, mixed", [(True, "bfloat16", "bf16"), (False, "float32", "none")]
)
def test_the_recipes_auto_precision_follows_the_cpu(monkeypatch, fast, served, mixed) -> None:
    config = recipe(monkeypatch, fast)
    assert (config.rollout.dtype, config.served_dtype) == (served, served)
    assert config.train.mixed_precision == mixed
    assert slow_bf16_warning(config, fast_bf16=fast) is None
    # the run directory records the choice: a resume on another CPU keeps the run's numerics
    saved = config.model_dump(mode="json")
    monkeypatch.setattr("relayrl.config.schema.bf16_is_fast", lambda device: not fast)
    again = RunConfig.model_validate(saved)
    assert (again.rollout.dtype, again.train.mixed_precision) == (served, mixed)


def test_auto_serves_a_lora_run_in_the_models_dtype(monkeypatch) -> None:
    """LoRA needs rollout.dtype = model.dtype (an explicit bfloat16 is refused): auto
    serves it in model.dtype and still trains under bf16 autocast where bf16 is fast."""
    lora = recipe(monkeypatch, True, "model.lora={r: 8}")
    assert (lora.served_dtype, lora.train.mixed_precision) == ("float32", "bf16")


def test_auto_asks_the_device_the_run_names(monkeypatch) -> None:
    asked: list[str] = []
    monkeypatch.setattr(
        "relayrl.config.schema.bf16_is_fast", lambda device: asked.append(device) or True
    )
    load_config(RECIPE, ["model.device=cuda:1"], resolve_model=False)
    assert asked == ["cuda:1"]
    assert bf16_is_fast("cpu") == cpu_has_fast_bf16()
    if not torch.cuda.is_available():  # a driver resolving a GPU node's config
        assert bf16_is_fast("cuda")


def test_explicit_bf16_warns_on_a_cpu_without_fast_bf16_and_names_both_keys(
    monkeypatch,
) -> None:
    config = recipe(monkeypatch, False, *EXPLICIT_BF16)
    warning = slow_bf16_warning(config, fast_bf16=False)
    assert warning is not None
    assert "rollout.dtype=bfloat16 and train.mixed_precision=bf16" in warning
    assert warning.endswith("add rollout.dtype=float32 train.mixed_precision=none")
    assert slow_bf16_warning(config, fast_bf16=True) is None


def test_only_the_bf16_keys_are_named_and_float32_or_cuda_are_silent(monkeypatch) -> None:
    served = recipe(monkeypatch, False, "rollout.dtype=bfloat16", "train.mixed_precision=none")
    warning = slow_bf16_warning(served, fast_bf16=False)
    assert warning is not None and "train.mixed_precision" not in warning.split(":")[0]
    fp32 = recipe(monkeypatch, False, "rollout.dtype=float32", "train.mixed_precision=none")
    assert slow_bf16_warning(fp32, fast_bf16=False) is None
    cuda = recipe(monkeypatch, False, "model.device=cuda", *EXPLICIT_BF16)
    assert slow_bf16_warning(cuda, fast_bf16=False) is None
