"""Shared prompts in the trainer (relayrl.train.shared_prompts): a group's prompt computed
once per micro-batch gives the logprobs, loss and update of the unshared pass, on a real
Hugging Face model (the suite's tiny Qwen3), with both attention implementations that take
a custom mask, uneven prompts and completions, a lone sample and a multi-turn episode."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from relayrl.models.loading import load_model
from relayrl.rollout.trajectory import ORIGIN_ENV, ORIGIN_MODEL, Trajectory
from relayrl.train.options import TrainerOptions
from relayrl.train.shared_prompts import Sharing, plan_prompt_units, sharing_for
from relayrl.train.trainer import RLTrainer, _collate
from tests.train.conftest import rl_config


def sample(prompt: list[int], group: str, k: int, length: int, rng: random.Random) -> Trajectory:
    ids = [rng.randrange(3, 60) for _ in range(length)]
    t = Trajectory(
        group, group, k, list(prompt), ids, [-rng.random() * 3 for _ in ids], [0] * length, 0
    )
    t.advantage = rng.uniform(-1, 1)
    return t


def batch(seed: int = 0) -> list[list[Trajectory]]:
    """Three groups: prompts of 7, 4 and 9 tokens, completions of 1-12 tokens; the last
    group is one sample alone; one sample of the first is a two-turn episode."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 60) for _ in range(n)] for n in (7, 4, 9)]
    groups = [
        [sample(prompts[0], "a", k, rng.randint(1, 12), rng) for k in range(4)],
        [sample(prompts[1], "b", k, rng.randint(1, 12), rng) for k in range(3)],
        [sample(prompts[2], "c", 0, 6, rng)],
    ]
    episode = groups[0][1]
    episode.origins = [ORIGIN_MODEL] * 3 + [ORIGIN_ENV] * (len(episode.completion_ids) - 3)
    return groups


def trainer_for(tmp_path, model, share: bool) -> RLTrainer:
    config = rl_config(
        tmp_path, "unused", "algo.loss=decoupled", f"optim.share_prompts={str(share).lower()}"
    )
    return RLTrainer(model, TrainerOptions.from_config(config), pad_id=0)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_logprobs_and_gradients_equal_the_unshared_pass(tiny_model_dir, attention):
    model = load_model(tiny_model_dir)
    model.set_attn_implementation(attention)
    sharing = sharing_for(model)
    assert sharing == Sharing(attention, None)
    trajs = [t for g in batch() for t in g]
    index = list(range(len(trajs)))
    plain = _collate(trajs, index, 0, torch.device("cpu"))
    packed = _collate(trajs, index, 0, torch.device("cpu"), sharing)
    assert plain.packed is None and packed.packed is not None
    # the prompt once per group: 3 rows instead of 8, and fewer positions computed
    assert packed.packed.input_ids.shape[0] == 3
    prompt_once = 7 + 4 + 9 + sum(len(t.completion_ids) for t in trajs)
    assert packed.packed.input_ids.shape[1] == max(
        7 + sum(len(t.completion_ids) for t in batch()[0]),
        4 + sum(len(t.completion_ids) for t in batch()[1]),
        9 + 6,
    )
    assert prompt_once < sum(t.num_tokens for t in trajs)

    trainer = RLTrainer.__new__(RLTrainer)  # _logprobs reads only these two
    trainer.temperature, trainer.options = 0.8, type("O", (), {"autocast_bf16": False})()
    out = {}
    for name, mb in (("plain", plain), ("packed", packed)):
        model.zero_grad()
        logp, _ = trainer._logprobs(model, mb)
        weights = torch.linspace(-1, 1, logp.numel()).reshape(logp.shape)
        (logp * mb.mask * weights).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        out[name] = (logp.detach() * mb.mask, grads)
    torch.testing.assert_close(out["packed"][0], out["plain"][0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out["packed"][1], out["plain"][1], atol=2e-5, rtol=1e-4)
    assert out["plain"][0].abs().sum() > 0  # the comparison covers real values


def test_a_train_step_with_shared_prompts_equals_the_unshared_step(tmp_path, tiny_model_dir):
    base = load_model(tiny_model_dir)
    results = {}
    for share in (False, True):
        trainer = trainer_for(tmp_path, copy.deepcopy(base), share)
        assert (trainer.sharing is not None) == share
        stats = trainer.train_step(batch())
        params = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        results[share] = (stats, params)
    (plain_stats, plain_params), (shared_stats, shared_params) = results[False], results[True]
    torch.testing.assert_close(shared_params, plain_params, atol=1e-6, rtol=1e-5)
    for key in ("loss", "entropy", "engine_trainer_kl_k3", "grad_norm"):
        if key in plain_stats:
            assert shared_stats[key] == pytest.approx(plain_stats[key], rel=1e-4, abs=1e-6), key
    assert shared_stats["train_tokens"] == plain_stats["train_tokens"]


def test_units_keep_a_group_together_and_respect_a_window():
    trajs = [t for g in batch() for t in g]
    # order of first appearance; a lone sample is its own unit
    assert plan_prompt_units(trajs, range(len(trajs)), None) == [[0, 1, 2, 3], [4, 5, 6], [7]]
    # a sliding window of 7 + 12 tokens splits the first group where its row would pass it
    units = plan_prompt_units(trajs, range(len(trajs)), 19)
    for unit in units:
        length = len(trajs[unit[0]].prompt_ids) + sum(len(trajs[i].completion_ids) for i in unit)
        assert length <= 19 or len(unit) == 1
    assert sorted(i for u in units for i in u) == list(range(len(trajs)))


def test_a_micro_batch_without_a_repeated_prompt_is_not_packed(tiny_model_dir):
    model = load_model(tiny_model_dir)
    trajs = [g[0] for g in batch()]
    mb = _collate(trajs, [0, 1, 2], 0, torch.device("cpu"), sharing_for(model))
    assert mb.packed is None


def test_attention_without_a_custom_mask_is_not_shared(tiny_model_dir):
    model = load_model(tiny_model_dir)
    model.config._attn_implementation = "flash_attention_2"  # read only, never run
    assert sharing_for(model) is None


def test_micro_batch_positions_count_a_shared_prompt_once(tmp_path, tiny_model_dir):
    """What the preflight scales the trainer's activations by: one group of four samples of
    a 7-token prompt is one packed row of 7 + all completions when shared, four right-padded
    rows of 7 + the longest completion when not."""
    group = batch()[0]
    lengths = [len(t.completion_ids) for t in group]
    for share, expected in ((True, 7 + sum(lengths)), (False, 4 * (7 + max(lengths)))):
        trainer = trainer_for(tmp_path, load_model(tiny_model_dir), share)
        assert trainer.micro_batch_positions(group) == [expected]


def test_the_preflights_probe_copies_are_rows_of_their_own(tmp_path, tiny_model_dir):
    """``relayrl check`` measures memory on copies of the sampled group as large as the run's
    largest micro-batch: with shared prompts each copy must be its own packed row (as a
    step's distinct prompts are), not one row three times as long."""
    from relayrl.train.preflight.live import _distinct_copies

    group = batch()[0]
    one = 7 + sum(len(t.completion_ids) for t in group)
    copies = [t for g in _distinct_copies(group, 3) for t in g]
    trainer = trainer_for(tmp_path, load_model(tiny_model_dir), True)
    assert trainer.micro_batch_positions(copies) == [3 * one]
    assert [t.prompt_ids[1:] for t in copies] == [t.prompt_ids[1:] for t in group] * 3
    assert len({tuple(t.prompt_ids) for t in copies}) == 3
