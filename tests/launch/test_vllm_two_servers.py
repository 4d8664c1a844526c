"""Two vLLM servers launched by the run, at the demo's η = 4, for 30 steps (issue 35: the
publication must hold with more than one server — every publication paused, loaded, verified
and resumed on both, none left paused, the requests of both servers in the batches).

The behaviour logprobs of the trainer's version equal the trainer's recompute
(``engine_trainer_kl_k3``), no sample is staler than η, every publication but possibly the
last is done on both servers (verified version and checksum; the first one's canary on
both), and both servers answered generate requests.

About 4 minutes on the 2-core CPU (two vLLM starts and 30 steps per publish mode): `pytest -m benchmark` runs
it; the suite's η = 4 run on one vLLM server is in tests/launch/test_vllm_backend.py."""

from __future__ import annotations

import json

import pytest

from tests.launch._vllm import (
    MAX_LOGPROB_DIFF,
    MAX_MEAN_K3,
    SHORT_RUN,
    needs_vllm,
    vllm_config,
)

pytestmark = [needs_vllm, pytest.mark.benchmark]
STEPS = 30
ETA = 4


@pytest.mark.parametrize("mode", ["retract", "abort"])
def test_two_launched_vllm_servers_at_eta_4_for_30_steps(tmp_path, tiny_model_dir, mode):
    from relayrl.train.run import run_train

    config = vllm_config(
        tiny_model_dir,
        f"output_dir={tmp_path}",
        "name=two",
        *SHORT_RUN,
        "rollout.num_servers=2",
        f"rollout.eta={ETA}",
        f"train.publish_mode={mode}",
        f"train.total_steps={STEPS}",
        "rollout.prompts_per_step=4",
        "rollout.n_samples=4",
    )
    result = run_train(config)
    run_dir = tmp_path / "two"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if not r.get("final")]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert result.summary["publications"] >= STEPS - 2  # the last may still be loading
    assert result.summary["publish_canaries"] >= 1
    assert result.summary["publish_canary_max_logprob_diff"] < MAX_LOGPROB_DIFF
    kl = [r["engine_trainer_kl_k3"] for r in steps if "engine_trainer_kl_k3" in r]
    # measured on the steps whose batch holds tokens of the trainer's own version (at η = 4
    # most batches are older)
    assert kl and all(k < MAX_MEAN_K3 for k in kl), kl
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").open()]
    assert all(s["trainer_version"] - s["version_min"] <= ETA for s in samples)
    for i in (0, 1):  # both servers generated (vLLM's access log of the token-in endpoint)
        log = (run_dir / f"server-{i}.log").read_text()
        assert log.count("/generate") >= STEPS // 2, f"server {i} served too few requests"
