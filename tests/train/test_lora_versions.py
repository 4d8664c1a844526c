"""A LoRA run whose servers keep the last K adapter versions (``rollout.max_adapters``,
docs/lora.md): at η = 2 with K = η + 1 no publication retracts a request (no KV is
recomputed), every sample's tokens come from one version, the engine's behaviour logprobs
equal the trainer's recompute to float rounding, and the servers report the requests each
publication left on their version; the combinations it needs are checked by the config."""

from __future__ import annotations

import pytest

from relayrl.config.loader import load_config
from relayrl.errors import RelayError
from relayrl.train.run import run_train
from tests.train.conftest import parity_grader, rl_config
from tests.train.test_lora import LORA, MAX_MEAN_K3, steps_of
from tests.train.test_resume import rows


def test_requests_keep_their_adapter_version_across_publications(tmp_path, tiny_model_dir):
    config = rl_config(
        tmp_path,
        tiny_model_dir,
        *LORA,
        "rollout.eta=2",
        "rollout.max_adapters=3",
        "rollout.max_new_tokens=48",
        "train.total_steps=5",
        "train.publish_canary_every=1",
    )
    result = run_train(config, grader=parity_grader)
    steps = steps_of(tmp_path / "run")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert all(r["staleness_max"] <= 2 for r in steps)
    kl = [r["engine_trainer_kl_k3"] for r in steps if "engine_trainer_kl_k3" in r]
    assert kl and all(k < MAX_MEAN_K3 for k in kl), kl
    final = rows(tmp_path / "run" / "metrics.jsonl")[-1]
    print(f"LoRA, K = 3, η = 2: kept_version {final['server_kept_version']}, kl {kl}")
    assert final["server_retracted"] == 0 and final["server_reprefill_tokens"] == 0
    assert result.summary["publications"] == 4
    assert result.summary["publish_canaries"] == 4
    for sample in rows(tmp_path / "run" / "samples.jsonl"):
        assert sample["version_min"] == sample["version_max"], sample


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.lora=null", "model.lora"),
        ("train.publish_mode=abort", "train.publish_mode"),
    ],
)
def test_adapters_at_once_need_lora_and_retract_publications(override, key):
    with pytest.raises(RelayError, match=f"rollout.max_adapters=3 needs {key}"):
        load_config(None, [*LORA, "rollout.max_adapters=3", override])
