"""``rollout.concurrency = -1`` (the default) resolves to 2·B·n requests in flight."""

from __future__ import annotations

from relayrl.config.loader import load_config
from relayrl.rollout.controller import auto_concurrency
from relayrl.train.run.rollout import controller_options


def test_default_concurrency_is_two_batches_of_requests():
    config = load_config(None, ["rollout.prompts_per_step=3", "rollout.n_samples=4"])
    assert config.rollout.concurrency == -1
    assert controller_options(config).concurrency == 24
    explicit = load_config(None, ["rollout.concurrency=0"])
    assert controller_options(explicit).concurrency == 0
    assert auto_concurrency(7, 8, 8) == 7
