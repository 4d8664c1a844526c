"""On-policy distillation end to end: a 3-step run on stale batches (lag emulation, η = 2)
with the teacher given as a model directory, started as one more (loopback) rollout server;
every trained token's advantage is the task advantage plus the teacher's reverse-KL reward,
and the teacher's logprobs are a plain forward pass of the teacher model."""

from __future__ import annotations

import json

import pytest
import torch

from relayrl.algo.advantages import compute_advantages
from relayrl.config.loader import load_config
from relayrl.models.loading import load_model
from relayrl.train.run import run_train
from relayrl.train.run.recorded import load_recorded_steps
from tests.engine.conftest import perturbed_state, recompute_logprobs
from tests.train.conftest import parity_grader, rl_config


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, tiny_model_dir):
    """The tiny model with other weights (a teacher that disagrees with the student)."""
    from relayrl.models.loading import load_tokenizer

    model = load_model(tiny_model_dir)
    model.load_state_dict(perturbed_state(model, seed=3, scale=0.2), strict=False)  # tied head
    out = tmp_path_factory.mktemp("teacher") / "model"
    model.save_pretrained(out)
    load_tokenizer(tiny_model_dir).save_pretrained(out)
    return out


def test_distillation_trains_from_a_teacher_server(tmp_path, tiny_model_dir, teacher_dir):
    coef, task_weight = 0.5, 1.0
    config = rl_config(
        tmp_path,
        tiny_model_dir,
        "rollout.lag=fixed",
        "rollout.eta=2",
        "rollout.temperature=0.9",
        "optim.lr=1e-3",
        "train.dump_trajectories=true",
        f"distill.teacher={teacher_dir}",
        f"distill.coef={coef}",
        f"distill.task_weight={task_weight}",
    )
    run_train(config, grader=parity_grader)
    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "grad_norm" in r]
    assert len(steps) == 3 and all(r["grad_norm"] > 0 for r in steps)
    assert max(r["staleness_max"] for r in steps) == 2
    teacher = load_model(teacher_dir)
    recorded = list(load_recorded_steps(run))
    for row, step in zip(steps, recorded, strict=True):  # the logged teacher KL, by hand
        r = [
            tl - b
            for t in step.trajectories
            for b, tl in zip(t.behav_logprobs, t.teacher_logprobs, strict=True)
        ]
        assert row["distill_teacher_kl"] == pytest.approx(-sum(r) / len(r), abs=1e-6)
    for step in recorded:
        groups: dict[str, list] = {}
        for t in step.trajectories:
            groups.setdefault(t.group_id, []).append(t)
        for group in groups.values():
            task = compute_advantages([[t.reward for t in group]], "grpo")[0]
            for t, a in zip(group, task, strict=True):
                expected_t = recompute_logprobs(teacher, t.prompt_ids, t.completion_ids, 0.9)
                assert t.teacher_logprobs == pytest.approx(expected_t, abs=1e-5)
                reward = torch.tensor(t.teacher_logprobs) - torch.tensor(t.behav_logprobs)
                expected = (task_weight * a + coef * reward).tolist()
                assert t.token_advantages == pytest.approx(expected, abs=1e-6)


def test_distill_config_names_a_bad_teacher(tmp_path):
    with pytest.raises(Exception, match="distill.teacher"):
        load_config(None, [f"distill.teacher={tmp_path / 'missing'}"])
    url = load_config(None, ["distill.teacher=http://127.0.0.1:9/"]).distill.teacher
    assert url == "http://127.0.0.1:9"


def test_teacher_directory_starts_as_a_server_process(tmp_path, teacher_dir):
    """``teacher_launcher`` in process mode: a real child server over the teacher's
    directory, its log under <run>/teacher, scoring as a plain forward pass."""
    import asyncio

    from relayrl.engine.client import RolloutClient
    from relayrl.launch.teacher import teacher_launcher, with_teacher_url

    config = load_config(
        None,
        ["model.max_context=128", f"distill.teacher={teacher_dir}", "rollout.server_threads=1"],
    )
    launcher = teacher_launcher(config, tmp_path)
    assert launcher is not None and launcher.is_process_mode
    try:
        url = launcher.start()[0]
        started = with_teacher_url(config, launcher)
        assert started.distill.teacher == url and started.distill.api_key == launcher.key_of(0)
        assert teacher_launcher(started, tmp_path) is None

        async def score():
            async with RolloutClient(url, api_key=launcher.key_of(0)) as client:
                return await client.input_logprobs([5, 6, 7], [[8, 9, 10]], 1.0)

        got = asyncio.run(score())[0]
    finally:
        launcher.stop()
    expected = recompute_logprobs(load_model(teacher_dir), [5, 6, 7], [8, 9, 10], 1.0)
    assert got == pytest.approx(expected, abs=1e-5)
    assert (tmp_path / "teacher" / "server-0.log").is_file()
