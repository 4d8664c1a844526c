"""`kill -9` a run of multi-turn episodes at random moments (once inside a checkpoint write),
resume each time: every prompt is trained exactly once per sample, in admission order, and
every trained trajectory is a whole episode (model turns and the environment's tokens, the
latter untrained); in-flight episodes were regenerated, none lost or duplicated."""

from __future__ import annotations

import json
import os
import random
import re
import signal
from collections import Counter

from relayrl.rollout.prompts import PromptLoader
from relayrl.rollout.trajectory import ORIGIN_ENV, ORIGIN_MODEL
from relayrl.tasks.registry import make_task
from tests.train.episode_env import TASK
from tests.train.test_resume_kill import (
    checkpointed,
    logs_identity,
    metric_steps,
    start,
    steps_into_attempt,
    wait_for,
)

CLI = (
    "import sys, tests.train.episode_env; from relayrl.cli import main; "
    "sys.exit(main(sys.argv[1:]))"
)
STEPS, B, N, ETA = 8, 2, 2, 2


def test_kill_9_mid_episode_then_resume_loses_and_duplicates_nothing(tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    config = tmp_path / "c.yaml"
    config.write_text(f"task:\n  name: {TASK}\n")
    first = [
        str(config),
        f"output_dir={tmp_path}",
        "name=run",
        f"model.path={tiny_model_dir}",
        "model.max_context=128",
        f"task.train_size={STEPS * B}",  # exactly one epoch
        f"rollout.prompts_per_step={B}",
        f"rollout.n_samples={N}",
        f"rollout.eta={ETA}",
        "rollout.max_new_tokens=40",
        "rollout.server_mode=thread",
        "algo.dynamic_sampling=false",
        f"train.total_steps={STEPS}",
        "train.checkpoint_every=1",
        "train.eval_every=0",
        "train.progress=false",
        "train.save_final=false",
        "train.dump_trajectories=true",
        "eval.num_problems=2",
        "eval.max_new_tokens=8",
        "runtime.threads=1",
    ]
    rng = random.Random(7)
    kills, outputs = [], []
    for trial, kind in enumerate(["random", "write"]):
        args = first if trial == 0 else ["--resume", str(run)]
        before = logs_identity(run)
        proc = start(args, "0.4" * (kind == "write"), CLI)
        target = checkpointed(run) + rng.randint(1, 2)
        try:
            alive = wait_for(steps_into_attempt(run, target, before), proc)
            if kind == "write":
                alive = alive and wait_for(lambda: any(run.glob("checkpoints/.tmp-step-*")), proc)
            if alive and proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                kills.append((kind, metric_steps(run)))
        finally:
            out, _ = proc.communicate(timeout=60)
            outputs.append(out.decode(errors="replace"))
    assert len(kills) == 2, outputs[-1][-2000:]
    last = start(["--resume", str(run)], "", CLI)
    out, _ = last.communicate(timeout=300)
    outputs.append(out.decode(errors="replace"))
    assert last.returncode == 0, outputs[-1][-3000:]
    restored = [int(n) for o in outputs for n in re.findall(r"(\d+) in-flight prompts restored", o)]
    assert len(restored) == 2 and max(restored) > 0  # episodes were cut mid-way and rerun

    import tests.train.episode_env  # noqa: F401 - the task, in this process too

    loader = PromptLoader(make_task(TASK).problems("train", STEPS * B, 0), seed=0)
    expected = Counter({loader.next()[1].id: N for _ in range(STEPS * B)})
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert Counter(r["prompt_id"] for r in samples) == expected
    keys = [(r["group_id"], r["sample_index"]) for r in samples]
    assert len(keys) == len(set(keys)) == STEPS * B * N
    assert {g for g, _ in keys} == {f"g{i}" for i in range(STEPS * B)}
    for record in samples:
        traj = record["trajectory"]
        assert traj["episode"]["turns"] >= 2 and ORIGIN_ENV in traj["origins"]
        assert traj["origins"][0] == ORIGIN_MODEL
        env = [i for i, o in enumerate(traj["origins"]) if o == ORIGIN_ENV]
        assert all(traj["behav_logprobs"][i] == 0.0 for i in env)
