"""Tokens by origin in training: a hand-built two-turn episode through the real trainer step
gives gradient at every model token and none at the environment's (checked per token on
the logits); the SFT of a tool demonstration does not train on the tool's output."""

from __future__ import annotations

import random

import torch

from relayrl.models.loading import load_model, load_tokenizer
from relayrl.rollout.trajectory import ORIGIN_ENV, ORIGIN_MODEL, Trajectory
from relayrl.tasks.tool_multiply import ToolMultiplyTask
from relayrl.train.options import TrainerOptions
from relayrl.train.sft import IGNORE_INDEX, encode_segments
from relayrl.train.trainer import RLTrainer, _collate
from tests.train.conftest import rl_config

PROMPT = [5, 6, 7]
# model turn, tool output, model turn
TURNS = [([10, 11, 12], ORIGIN_MODEL), ([13, 14, 15, 16], ORIGIN_ENV), ([17, 18], ORIGIN_MODEL)]


def episode(sample_index: int, advantage: float) -> Trajectory:
    ids = [t for part, _ in TURNS for t in part]
    origins = [o for part, o in TURNS for _ in part]
    behav = [-1.0 if o == ORIGIN_MODEL else 0.0 for o in origins]
    t = Trajectory(
        "p0", "g0", sample_index, list(PROMPT), ids, behav, [0] * len(ids), 0, origins=origins
    )
    t.advantage = advantage
    return t


def test_environment_tokens_get_no_gradient(tmp_path, tiny_model_dir):
    # one row per trajectory, so the output head's gradient reads per position (the packed
    # layout of shared prompts gives the same gradient: tests/train/test_shared_prompts.py)
    config = rl_config(tmp_path, tiny_model_dir, "algo.loss=decoupled", "optim.share_prompts=false")
    model = load_model(tiny_model_dir)
    trainer = RLTrainer(model, TrainerOptions.from_config(config), pad_id=0)
    grads: list[torch.Tensor] = []

    def keep_grad(module, inputs, output):
        if output.requires_grad:
            output.register_hook(lambda g: grads.append(g.detach().clone()))

    model.lm_head.register_forward_hook(keep_grad)
    trajs = [episode(0, 1.0), episode(1, -1.0)]
    stats = trainer.train_step([trajs])
    assert len(grads) == 1 and trainer.version == 1
    # [rows, positions]: the gradient reaching each logit row; the output head runs from the
    # first completion position (p - 1) on, so prompt positions get none by construction
    per_position = grads[0].abs().sum(-1)
    p = len(PROMPT)
    origins = trajs[0].origins
    assert per_position.shape[1] == len(origins) + 1  # positions p-1 .. p-1+len(origins)
    for row in range(2):
        for i, origin in enumerate(origins):
            g = float(per_position[row, i])  # logits at p-1+i predict completion token i
            if origin == ORIGIN_ENV:
                assert g == 0.0, (row, i)
            else:
                assert g > 0.0, (row, i)
    assert stats["train_tokens"] == 2 * (p + len(origins))

    mb = _collate(trajs, [0, 1], pad_id=0, device=torch.device("cpu"))
    expected = [0.0] * (p - 1) + [float(o == ORIGIN_MODEL) for o in origins]
    assert mb.mask[0].tolist() == expected


def test_sft_does_not_train_on_tool_output(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    task = ToolMultiplyTask()
    problem = task.problems("train", 1, 0)[0]
    segments = task.demonstration_segments(problem, random.Random(0))
    assert [trained for _, trained in segments] == [True, False, True]
    ids, labels = encode_segments(tokenizer, problem.prompt, segments)
    enc = [tokenizer(text, add_special_tokens=False)["input_ids"] for text, _ in segments]
    start = len(ids) - 1 - sum(map(len, enc))
    call, out, answer = (
        slice(start, start + len(enc[0])),
        slice(start + len(enc[0]), start + len(enc[0]) + len(enc[1])),
        slice(start + len(enc[0]) + len(enc[1]), len(ids)),
    )
    assert labels[out] == [IGNORE_INDEX] * len(enc[1])
    assert labels[call] == ids[call] and labels[answer] == ids[answer]
    assert labels[-1] == tokenizer.eos_token_id
    assert labels[:start] == [IGNORE_INDEX] * start
