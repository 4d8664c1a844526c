"""A short real run of configs/tool_use.yaml (SFT warm start, then asynchronous RL over
calculator episodes on rollout-server processes) raises held-out pass@1 and the tool-call
rate above the SFT model's, measured on the same problems with the same seeds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.config.loader import load_config
from relayrl.models.loading import load_model, load_tokenizer
from relayrl.tasks.registry import make_task
from relayrl.train.loop import evaluate_model
from relayrl.train.run import run_train

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tool_use.yaml"
EVAL_PROBLEMS = 100


# about 2 min on an idle 2-core CPU (SFT warm start + 40 RL steps + two evaluations), too long
# for the 15-minute suite, whose episode tests (tests/rollout/test_episodes.py,
# tests/train/test_resume_kill_episodes.py) cover the same code paths: `pytest -m benchmark`
# runs this one
@pytest.mark.benchmark
def test_rl_over_tool_episodes_beats_the_sft_base(tmp_path):
    config = load_config(
        CONFIG,
        [
            f"output_dir={tmp_path}",
            "name=tool",
            "train.eval_every=0",
            "train.checkpoint_every=0",
            "train.save_final=false",
            "train.progress=false",
            f"eval.num_problems={EVAL_PROBLEMS}",
        ],
    )
    result = run_train(config)  # SFT warm start (<run>/sft_model), then RL
    sft_dir = tmp_path / "tool" / "sft_model"
    problems = make_task(config.task.name).problems("test", EVAL_PROBLEMS, config.task.seed)
    base = evaluate_model(
        load_model(sft_dir), load_tokenizer(sft_dir), problems, config.eval, config.seed
    )
    final = json.loads((tmp_path / "tool" / "metrics.jsonl").read_text().splitlines()[-1])
    print(
        f"base_pass@1={base.pass_at_1:.3f} final_pass@1={result.final_pass_at_1:.3f} "
        f"tool-call rate {base.episode['tool_calls_rate']:.2f} -> "
        f"{final['eval_episode_tool_calls_rate']:.2f}"
    )
    # 100 problems: a standard error of about 0.05 each side, so +0.15 is no accident
    assert result.final_pass_at_1 >= base.pass_at_1 + 0.15
    assert final["eval_episode_tool_calls_rate"] >= base.episode["tool_calls_rate"] + 0.2
    assert final["eval_episode_turns"] > 1.0  # episodes really had several turns
