"""Fixtures of the RL tests: small run configs over the tiny model, a quick SFT model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from relayrl.config.loader import load_config

torch.set_num_threads(1)


def parity_grader(problem, completion: str) -> float:
    """A cheap reward with varied values on a random model: 1 for an even-length answer."""
    return float(len(completion) % 2 == 0)


QUICK_TASK = "{max_steps: 3, max_value: 9, max_operand: 5}"


def rl_config(tmp_path: Path, model_dir: Path | str, *overrides: str):
    """A tiny, fast RL run config writing under ``tmp_path``."""
    base = [
        f"output_dir={tmp_path}",
        "name=run",
        f"model.path={model_dir}",
        "model.max_context=128",
        "rollout.prompts_per_step=2",
        "rollout.n_samples=4",
        "rollout.max_new_tokens=16",
        "rollout.server_mode=thread",
        "algo.dynamic_sampling=false",
        "train.total_steps=3",
        "train.eval_every=0",
        "train.progress=false",
        "train.save_final=true",
        "eval.num_problems=4",
        "eval.max_new_tokens=16",
        "train.trainer_threads=1",
        "runtime.threads=1",
    ]
    return load_config(None, base + list(overrides))


@pytest.fixture(scope="session")
def sft_model_dir(tmp_path_factory) -> Path:
    """A quick SFT warm start of the tiny model on short single-digit chains: competent
    at the lookups, but half its demonstrations carry one planted wrong step (the default
    ``sft.wrong_fraction``), which RL has to unlearn."""
    from relayrl.train.sft import run_sft

    out = tmp_path_factory.mktemp("sft")
    config = load_config(
        None,
        [
            f"output_dir={out}",
            "name=sft",
            "model.preset=tiny",
            "model.max_context=128",
            "task.train_size=1000",
            f"task.params={QUICK_TASK}",
            "sft.steps=600",
            "sft.batch_size=32",
            "eval.num_problems=50",
            "eval.max_new_tokens=32",
            # both cores when the suite runs in one process; under `make test`'s two
            # workers the other core is the other worker's
            f"runtime.threads={1 if os.environ.get('PYTEST_XDIST_WORKER') else 2}",
        ],
    )
    try:
        run_sft(config, progress=False)
    finally:
        torch.set_num_threads(1)  # tests/conftest.py's one thread per test process
    return out / "sft" / "sft_model"


RECORDED_OVERRIDES = ("rollout.eta=1", "train.dump_trajectories=true")


@pytest.fixture(scope="session")
def recorded_run(tmp_path_factory, tiny_model_dir) -> Path:
    """A real 3-step asynchronous run (η = 1) recorded with full trajectories, default
    loggers (TensorBoard when installed); returns its run directory."""
    from relayrl.train.run import run_train

    tmp = tmp_path_factory.mktemp("recorded")
    run_train(rl_config(tmp, tiny_model_dir, *RECORDED_OVERRIDES), grader=parity_grader)
    return tmp / "run"


def base_pass_at_1(config, model_dir: Path, num_problems: int) -> float:
    """Held-out pass@1 of the model in ``model_dir`` on the first ``num_problems`` test
    problems of ``config``'s task, sampled as ``config.eval`` says (the RL run's baseline)."""
    from relayrl.models.loading import load_model, load_tokenizer
    from relayrl.tasks.registry import make_task
    from relayrl.train.loop import evaluate_model

    problems = make_task(config.task.name, config.task.params).problems(
        "test", num_problems, config.task.seed
    )
    model = load_model(model_dir, "cpu", "float32")
    return evaluate_model(
        model, load_tokenizer(model_dir), problems, config.eval, config.seed
    ).pass_at_1
