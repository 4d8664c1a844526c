"""``relayrl bench trl-gradient`` on a tiny model: on the same sampled groups, relayrl's
``train_step`` and TRL ``GRPOTrainer``'s loss (the benchmark's ``GRPOConfig``) give the same
gradient, up to TRL's advantage epsilon, and the check tells a different batch apart."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from relayrl.bench.trl import run_config
from relayrl.bench.trl_gradient import (
    Sample,
    compare,
    relayrl_gradient,
    relayrl_update,
    sample_groups,
    trl_gradient,
    trl_inputs,
    trl_update,
)
from relayrl.errors import RelayError
from relayrl.models.loading import encode_prompt, load_tokenizer
from relayrl.tasks.registry import make_task
from tests.bench._settings import TINY

pytest.importorskip("trl", reason="TRL is the `bench` extra (pip install -e .[bench])")

SETTINGS = replace(TINY, prompts_per_step=3, n_samples=4, max_new_tokens=8)
REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]]


def hand_groups(model_dir, rewards=REWARDS):
    """Three prompts of the task, four completions each of 3-8 tokens (half end in EOS)."""
    tokenizer = load_tokenizer(model_dir)
    problems = make_task("arithmetic").problems("train", len(rewards), 0)
    gen = torch.Generator().manual_seed(0)
    groups = []
    for i, group_rewards in enumerate(rewards):
        ids = encode_prompt(tokenizer, problems[i].prompt)
        group = []
        for j, reward in enumerate(group_rewards):
            n = 3 + (i + 2 * j) % 6
            completion = torch.randint(5, tokenizer.vocab_size - 1, (n,), generator=gen).tolist()
            if j % 2 == 0:
                completion[-1] = tokenizer.eos_token_id
            group.append(Sample(ids, completion, [0.0] * n, reward))
        groups.append(group)
    return groups


def test_relayrl_and_trl_compute_the_same_gradient(tiny_model_dir, tmp_path):
    config = run_config(SETTINGS, tmp_path, tiny_model_dir, side="relayrl_sync")
    groups = hand_groups(tiny_model_dir)
    ours = relayrl_gradient(config, tiny_model_dir, groups, autocast=False)
    theirs = trl_gradient(SETTINGS, config, tiny_model_dir, tmp_path, groups, bf16=False)
    same = compare(ours, theirs)
    # the advantages' eps (1e-6 against TRL's 1e-4 over a std of ~0.5) scales the gradient by
    # ~2e-4; every other difference is float32 rounding
    assert same.cosine > 1 - 1e-9
    assert same.relative_l2 < 5e-4
    assert same.norm_a == pytest.approx(same.norm_b, rel=5e-4)

    flipped = [list(g) for g in REWARDS]
    flipped[1] = [1.0, 0.0, 0.0, 0.0]  # another sample of the second prompt is the right one
    other = trl_gradient(
        SETTINGS, config, tiny_model_dir, tmp_path, hand_groups(tiny_model_dir, flipped), False
    )
    assert compare(ours, other).cosine < 0.99


def test_three_steps_of_each_trainer_move_the_weights_alike(tiny_model_dir, tmp_path):
    """Past one gradient: relayrl's AdamW, clipping and schedule over three steps against
    TRL's own loop (the transformers Trainer) on the same three batches."""
    config = run_config(replace(SETTINGS, steps=3), tmp_path, tiny_model_dir, side="relayrl_sync")
    rewards = [
        REWARDS,
        [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]],
        [[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0]],
    ]
    batches = [hand_groups(tiny_model_dir, r) for r in rewards]
    ours = relayrl_update(config, tiny_model_dir, batches, autocast=False)
    theirs = trl_update(SETTINGS, config, tiny_model_dir, tmp_path, batches, bf16=False)
    same = compare(ours, theirs)
    assert same.cosine > 1 - 1e-6
    assert same.relative_l2 < 2e-3
    assert compare(ours, relayrl_update(config, tiny_model_dir, batches[:2], False)).cosine < 0.99


def test_trl_inputs_pad_prompts_left_and_completions_right():
    groups = [
        [Sample([5, 6], [7, 2], [0.0, 0.0], 1.0), Sample([5, 6], [8], [0.0], 0.0)],
        [Sample([9], [3, 4, 2], [0.0] * 3, 0.0), Sample([9], [2], [0.0], 0.0)],
    ]
    inputs = trl_inputs(groups, pad_id=0)
    assert inputs["prompt_ids"].tolist() == [[5, 6], [5, 6], [0, 9], [0, 9]]
    assert inputs["prompt_mask"].tolist() == [[1, 1], [1, 1], [0, 1], [0, 1]]
    assert inputs["completion_ids"].tolist() == [[7, 2, 0], [8, 0, 0], [3, 4, 2], [2, 0, 0]]
    assert inputs["completion_mask"].tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]]
    assert int(inputs["num_items_in_batch"]) == 7
    # group 1: rewards 1, 0 → mean 0.5, unbiased std √0.5; group 2 all equal → 0
    a = 0.5 / (0.5**0.5 + 1e-4)
    assert inputs["advantages"].tolist() == pytest.approx([a, -a, 0.0, 0.0])


def test_no_group_with_mixed_rewards_is_a_clear_error(tiny_model_dir, tmp_path):
    config = run_config(SETTINGS, tmp_path, tiny_model_dir, side="relayrl_sync")
    # a random tiny model answers nothing right: every group's rewards are 0
    with pytest.raises(RelayError, match="no group with mixed rewards in 2 prompts"):
        sample_groups(config, tiny_model_dir, max_prompts=2, progress=False)
