"""A short real asynchronous run (rollout server processes, η = 2) raises the held-out
pass@1 of a quick SFT model."""

from __future__ import annotations

import json
import time

import pytest

from relayrl.config.loader import load_config
from relayrl.train.rl import run_train


@pytest.mark.xfail(
    reason="not yet tuned for the test's quick SFT fixture: on the configs/sft.yaml base "
    "(pass@1 0.22, ~2.4 min of SFT) lr 1e-4, B 16, n 8, 64 tokens, 40 steps rose to 0.31/0.36 "
    "(2 seeds, ~65 s each) but lr 5e-4, B 8 fell to 0.19 (docs/async.md); the fixture and "
    "reliability over more seeds are not done yet",
    strict=False,
)
def test_short_async_run_beats_the_sft_base(tmp_path, sft_model_dir):
    base = json.loads((sft_model_dir.parent / "sft_summary.json").read_text())["base_pass@1"]
    config = load_config(
        None,
        [
            f"output_dir={tmp_path}",
            "name=rl",
            f"model.path={sft_model_dir}",
            "model.max_context=128",
            "task.train_size=2000",
            "task.test_size=100",
            "task.params={max_steps: 2, max_value: 30, max_operand: 5}",
            "rollout.prompts_per_step=8",
            "rollout.n_samples=8",
            "rollout.max_new_tokens=32",
            "rollout.eta=2",
            "optim.lr=2e-3",
            "train.total_steps=12",
            "algo.dynamic_sampling=false",
            "train.progress=false",
            "eval.num_problems=100",
            "eval.max_new_tokens=32",
        ],
    )
    start = time.monotonic()
    result = run_train(config)
    assert time.monotonic() - start < 150
    print(f"base_pass@1={base:.2f} final_pass@1={result.final_pass_at_1:.2f}")
    assert result.final_pass_at_1 > base
