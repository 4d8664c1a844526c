"""bf16 on a CPU that emulates it: the run warns and names the overrides that make it fast
(on an AVX2-only EPYC, `relayrl eval` of the recipe took 3.7x as long in bf16 as in float32:
docs/real-model.md)."""

from __future__ import annotations

from relayrl.config.loader import load_config
from relayrl.train.run.start import slow_bf16_warning

RECIPE = "configs/smollm2.yaml"


def test_the_recipe_warns_on_a_cpu_without_fast_bf16_and_names_both_keys() -> None:
    config = load_config(RECIPE, resolve_model=False)
    warning = slow_bf16_warning(config, fast_bf16=False)
    assert warning is not None
    assert "rollout.dtype=bfloat16 and train.mixed_precision=bf16" in warning
    assert warning.endswith("add rollout.dtype=float32 train.mixed_precision=none")
    assert slow_bf16_warning(config, fast_bf16=True) is None


def test_only_the_bf16_keys_are_named_and_float32_or_cuda_are_silent() -> None:
    served = load_config(RECIPE, ["train.mixed_precision=none"], resolve_model=False)
    warning = slow_bf16_warning(served, fast_bf16=False)
    assert warning is not None and "train.mixed_precision" not in warning.split(":")[0]
    fp32 = load_config(
        RECIPE, ["rollout.dtype=float32", "train.mixed_precision=none"], resolve_model=False
    )
    assert slow_bf16_warning(fp32, fast_bf16=False) is None
    cuda = load_config(RECIPE, ["model.device=cuda"], resolve_model=False)
    assert slow_bf16_warning(cuda, fast_bf16=False) is None
