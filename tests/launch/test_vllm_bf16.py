"""A bf16 vLLM server (`rollout.dtype=bfloat16`, the SmolLM2 recipe's) takes fp32 weights
from the trainer and holds them rounded to bf16. Every publication must verify: the
trainer's expected checksum (its weights rounded to the served dtype) and the one the
server reports for what it loaded go through the same rule
(``relayrl_transfer_wire.served_checksum``). Before, the server checksummed the fp32 tensors
it was given and the recipe on vLLM stopped at its first publication ("verify step: it
loaded weights with checksum …, not the published …").

About 1 minute on the 2-core CPU (a vLLM start, 3 steps at η = 0): `pytest -m benchmark`
runs it. The suite keeps the rule itself: tests/sync/test_served_dtype.py."""

from __future__ import annotations

import json

import pytest

from relayrl.train.run import run_train
from tests.launch._vllm import SHORT_RUN, needs_vllm, vllm_config

pytestmark = [needs_vllm, pytest.mark.benchmark]


def test_a_bf16_vllm_server_verifies_every_publication(tmp_path, tiny_model_dir):
    config = vllm_config(
        tiny_model_dir,
        f"output_dir={tmp_path}",
        "name=bf16",
        *SHORT_RUN,
        "rollout.dtype=bfloat16",
        "rollout.eta=0",  # each step waits for the previous publication: all 2 complete
        "train.total_steps=3",
    )
    run_train(config)
    rows = [json.loads(line) for line in (tmp_path / "bf16" / "metrics.jsonl").open()]
    steps = [r for r in rows if "published_version" in r]
    assert [r["published_version"] for r in steps] == [0.0, 1.0, 2.0]
    # bf16 rounding moves the behaviour logprobs off the fp32 trainer's, but not far
    assert all(0 < r["engine_trainer_kl_k3"] < 0.05 for r in steps), steps
