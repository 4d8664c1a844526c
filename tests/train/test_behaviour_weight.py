"""At η = 0 the behaviour weight w = π_prox/μ is 1: real trajectories of the built-in engine
(tiny model, mixed lengths, so micro-batches are padded) through the trainer's own
collation and logprob recompute give |log w| < 1e-5 on every token. An off-by-one in the
token alignment would not: the same logprobs one position apart differ by far more."""

from __future__ import annotations

import pytest
import torch

from relayrl.config.loader import load_config
from relayrl.engine.engine import Engine
from relayrl.engine.types import EngineOptions, SamplingParams
from relayrl.models.loading import encode_prompt, load_model, load_tokenizer
from relayrl.rollout.trajectory import Trajectory
from relayrl.tasks.registry import make_task
from relayrl.train.options import TrainerOptions
from relayrl.train.trainer import RLTrainer


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_trajectories_have_unit_behaviour_weight_at_eta0(tiny_model_dir, temperature):
    config = load_config(
        None,
        [
            "model.max_context=128",
            "rollout.eta=0",
            f"rollout.temperature={temperature}",
            "train.drift_metrics=true",
        ],
    )
    tokenizer = load_tokenizer(tiny_model_dir)
    torch.manual_seed(0)
    trainer = RLTrainer(
        load_model(tiny_model_dir),
        TrainerOptions.from_config(config),
        pad_id=tokenizer.pad_token_id,
    )
    problems = make_task("arithmetic").problems("train", 8, 0)
    prompts = [encode_prompt(tokenizer, p.prompt) for p in problems]
    params = [SamplingParams(24, temperature, seed=i) for i in range(len(prompts))]
    with Engine(load_model(tiny_model_dir), tokenizer, EngineOptions(max_seq_len=128)) as engine:
        outs = engine.generate_batch(prompts, params)
    trajs = [
        Trajectory(p.id, f"g{i}", 0, ids, o.output_ids, o.output_logprobs, o.output_versions, 0)
        for i, (p, ids, o) in enumerate(zip(problems, prompts, outs, strict=True))
    ]
    assert len({t.num_tokens for t in trajs}) > 1  # rows of one micro-batch are padded

    prox = trainer.traj_logprobs(trainer.model, trajs)
    behav = [torch.tensor(t.behav_logprobs) for t in trajs]
    log_w = torch.cat([p - b for p, b in zip(prox, behav, strict=True)])
    assert log_w.numel() == sum(len(t.completion_ids) for t in trajs)
    assert log_w.abs().max().item() < 1e-5
    shifted = torch.cat([p[1:] - b[:-1] for p, b in zip(prox, behav, strict=True)])
    assert shifted.abs().max().item() > 0.1  # what an off-by-one would look like

    stats = trainer.train_step([trajs])  # the step's own statistics say the same
    assert abs(stats["is_weight_mean"] - 1.0) < 1e-5
    assert stats["behav_prox_kl_k3"] < 1e-9
    assert stats["engine_trainer_kl_tokens"] == log_w.numel()


def _loop(*overrides: str):
    from relayrl.train.loop import TrainingLoop

    config = load_config(None, list(overrides))
    return TrainingLoop(config, None, None, None, [], [], total_steps=3)


def test_off_policy_weight_at_eta0_is_warned_about_once(capsys):
    from relayrl.train.loop import IS_WEIGHT_TOLERANCE

    loop = _loop("rollout.eta=0")
    loop._check_on_policy({"step": 1, "is_weight_mean": 1.0 + IS_WEIGHT_TOLERANCE / 2})
    assert capsys.readouterr().err == ""  # within the tolerance
    loop._check_on_policy({"step": 2, "is_weight_mean": 1.3})
    loop._check_on_policy({"step": 3, "is_weight_mean": 0.5})
    err = capsys.readouterr().err
    assert err.count("warning:") == 1
    assert "step 2: is_weight_mean = 1.3000 at rollout.eta=0" in err


@pytest.mark.parametrize("overrides", [["rollout.eta=1"], ["rollout.eta=0", "replay.enable=true"]])
def test_stale_or_replayed_weights_are_not_warned_about(capsys, overrides):
    loop = _loop(*overrides)
    loop._check_on_policy({"step": 1, "is_weight_mean": 1.3})
    assert capsys.readouterr().err == ""
