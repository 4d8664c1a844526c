"""``relayrl bench trl``'s TRL side, executed for real on a tiny model (where TRL is
installed: the ``bench`` extra, which ``make test`` installs): every setting the headline
comparison calls "matched" reaches TRL's ``GRPOConfig`` with relayrl's value, and the side
trains its steps and evaluates on its schedule."""

from __future__ import annotations

import pytest

from relayrl.bench.trl import _trl_side, run_config
from tests.bench._settings import TINY

trl = pytest.importorskip("trl", reason="TRL is the `bench` extra (pip install -e .[bench])")


def test_the_trl_side_trains_with_relayrls_settings(tiny_model_dir, tmp_path, monkeypatch):
    seen = {}
    original_init = trl.GRPOTrainer.__init__

    def recording_init(self, *args, **kwargs):
        seen["args"] = kwargs["args"]
        seen["optimizers"] = kwargs["optimizers"]
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(trl.GRPOTrainer, "__init__", recording_init)
    result = _trl_side(TINY, tmp_path, tiny_model_dir)

    config = run_config(TINY, tmp_path, tiny_model_dir)
    args, optim, algo = seen["args"], config.optim, config.algo
    matched = {
        "max_steps": 2,
        "per_device_train_batch_size": TINY.samples_per_step,
        "num_generations": TINY.n_samples,
        "max_completion_length": TINY.max_new_tokens,
        "temperature": config.rollout.temperature,
        "learning_rate": optim.lr,
        "adam_beta1": optim.betas[0],
        "adam_beta2": optim.betas[1],
        "max_grad_norm": optim.grad_clip,
        "beta": algo.kl_coef,
        "epsilon": algo.eps_low,
        "epsilon_high": algo.eps_high,
        "loss_type": "dapo",  # token mean over the step's tokens: relayrl's token_mean
        "importance_sampling_level": "token",
        "num_iterations": 1,
        "gradient_checkpointing": False,
        "bf16": False,
    }
    assert {k: getattr(args, k) for k in matched} == matched
    optimizer, _ = seen["optimizers"]
    assert optimizer.defaults["lr"] == optim.lr
    assert optimizer.defaults["weight_decay"] == optim.weight_decay

    assert result.side == "trl" and result.samples == 2 * TINY.samples_per_step
    assert [step for step, _, _ in result.curve] == [0, 1, 2]
    elapsed = [t for _, t, _ in result.curve]
    assert elapsed == sorted(elapsed) and all(0.0 <= p <= 1.0 for _, _, p in result.curve)
    # one training reward per step, logged by TRL itself (learning per step beside relayrl's)
    assert [step for step, _ in result.train_reward] == [1, 2]
    assert all(0.0 <= r <= 1.0 for _, r in result.train_reward)
