"""Faults during a run that must not stop it: a rollout server killed (-9) and, after its
restart, the new one hung (SIGSTOP); a grading worker crashing and one hanging. Training
finishes, every prompt is trained exactly as in a run without faults, each fault is
counted."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

from relayrl.rollout.controller import PromptLoader
from relayrl.tasks.registry import make_task
from relayrl.train.rl import run_train
from tests.launch._faulty import FAULT_DIR_ENV, faulty_grader
from tests.train.conftest import rl_config
from tests.train.test_train_failures import children_of, is_serve


def serve_pids() -> list[int]:
    return [p for p in children_of(os.getpid()) if is_serve(p)]


def steps_logged(run: Path) -> int:
    try:
        return (run / "metrics.jsonl").read_text().count("\n")
    except OSError:
        return 0


def inject_server_faults(run: Path, done: list[str]) -> None:
    """kill -9 the server after the first step; SIGSTOP its replacement after one more."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and steps_logged(run) < 1:
        time.sleep(0.05)
    (first,) = serve_pids()
    os.kill(first, signal.SIGKILL)
    done.append(f"kill -9 {first}")
    after = steps_logged(run)
    while time.monotonic() < deadline:
        pids = [p for p in serve_pids() if p != first]
        if pids and steps_logged(run) > after:
            os.kill(pids[0], signal.SIGSTOP)
            done.append(f"SIGSTOP {pids[0]}")
            return
        time.sleep(0.05)


def test_server_crash_and_hang_and_grader_faults_lose_no_prompt(
    tmp_path, tiny_model_dir, monkeypatch
):
    steps, b, n = 16, 2, 2
    monkeypatch.setenv(FAULT_DIR_ENV, str(tmp_path))
    config = rl_config(
        tmp_path,
        tiny_model_dir,
        "rollout.server_mode=process",
        "rollout.eta=1",
        f"rollout.prompts_per_step={b}",
        f"rollout.n_samples={n}",
        f"task.train_size={steps * b}",
        f"train.total_steps={steps}",
        "train.save_final=false",
        "rollout.server_hang_timeout_s=2",
        "rollout.max_server_restarts=2",
        "rollout.reward_workers=2",
        "rollout.reward_timeout_s=1",
    )
    run = tmp_path / "run"
    injected: list[str] = []
    thread = threading.Thread(target=inject_server_faults, args=(run, injected), daemon=True)
    thread.start()
    run_train(config, grader=faulty_grader)
    thread.join(timeout=1)
    assert len(injected) == 2, injected

    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    loader = PromptLoader(make_task("arithmetic").problems("train", steps * b, 0), seed=0)
    assert Counter(r["prompt_id"] for r in samples) == {
        loader.next()[1].id: n for _ in range(steps * b)
    }
    assert len({(r["group_id"], r["sample_index"]) for r in samples}) == steps * b * n
    statuses = Counter(r["reward_status"] for r in samples)
    assert statuses["crash"] == 1 and statuses["timeout"] == 1, statuses
    assert all(r["reward"] == 0.0 for r in samples if r["reward_status"] != "ok")

    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-2])  # before "final"
    assert last["step"] == steps
    assert last["server_restarts"] == 2 and last["server_failovers"] >= 1, last
    assert last["grading_crash"] == 1 and last["grading_timeout"] == 1
    assert last["grading_restarts"] >= 2
    log = (run / "server-0.log").read_text()
    assert log.count("----- restarted at") == 2
    assert not serve_pids()  # every server stopped, the hung one included
