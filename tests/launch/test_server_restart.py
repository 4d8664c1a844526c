"""Faults during a run that must not stop it: a rollout server killed (-9) and, after its
restart, the new one hung (SIGSTOP) just as a publication begins, so the publication waits on
it (the watchdog must find the hang while the publication holds the supervisor lock); a
grading worker crashing and one hanging. Training finishes, every prompt is trained exactly
as in a run without faults, each fault is counted.

The test never hangs and never leaves a stopped process behind: past ``RUN_LIMIT_S`` its
guard kills the run's servers (SIGCONT, SIGKILL) until the run ends (it then fails naming
the limit), and whatever it stopped is killed at the end whatever happened."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

from relayrl.launch.supervisor import ServerSupervisor
from relayrl.rollout.prompts import PromptLoader
from relayrl.sync.weight_sync import WeightSync
from relayrl.tasks.registry import make_task
from relayrl.train.run import run_train
from tests.launch._faulty import FAULT_DIR_ENV, faulty_grader
from tests.train.conftest import rl_config
from tests.train.test_train_failures import children_of, is_serve

RUN_LIMIT_S = 150  # about 25 s on 2 cores


def serve_pids() -> list[int]:
    return [p for p in children_of(os.getpid()) if is_serve(p)]


def steps_logged(run: Path) -> int:
    try:
        return (run / "metrics.jsonl").read_text().count("\n")
    except OSError:
        return 0


def end_for_good(pid: int) -> None:
    """SIGCONT then SIGKILL ``pid`` if it is still one of this process's servers."""
    if pid in serve_pids():
        for sig in (signal.SIGCONT, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


class Faults:
    """kill -9 the server after the first step (from a thread, as from outside); SIGSTOP its
    replacement at the first publication after it has served a step (``publish`` wraps
    ``WeightSync.deliver``)."""

    def __init__(self, run: Path) -> None:
        self.run = run
        self.done: list[str] = []
        self.stopped: list[int] = []
        self.killed: int | None = None
        self.steps_at_kill = 0
        self.finished = threading.Event()

    def kill_first_server(self) -> None:
        deadline = time.monotonic() + RUN_LIMIT_S
        while steps_logged(self.run) < 1:
            if self.finished.wait(0.05) or time.monotonic() > deadline:
                return
        (first,) = serve_pids()
        self.steps_at_kill = steps_logged(self.run)
        os.kill(first, signal.SIGKILL)
        self.killed = first
        self.done.append(f"kill -9 {first}")

    def before_publish(self, supervisor: ServerSupervisor) -> None:
        if self.killed is None or self.stopped or supervisor.restarts != 1:
            return
        if steps_logged(self.run) <= self.steps_at_kill:
            return
        (pid,) = supervisor.launcher.pids
        os.kill(pid, signal.SIGSTOP)
        self.stopped.append(pid)
        self.done.append(f"SIGSTOP {pid}")

    def guard(self) -> list[str]:
        """Past RUN_LIMIT_S, kill the servers (over and over) so that the run ends."""
        fired: list[str] = []

        def watch() -> None:
            if self.finished.wait(RUN_LIMIT_S):
                return
            fired.append(f"the run was still going after {RUN_LIMIT_S}s")
            while not self.finished.wait(1.0):
                for pid in serve_pids():
                    end_for_good(pid)

        threading.Thread(target=watch, daemon=True).start()
        return fired


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
    faults = Faults(run)
    publish = WeightSync.deliver

    async def publish_with_fault(self, *args, **kwargs):
        faults.before_publish(self.supervisor)
        return await publish(self, *args, **kwargs)

    monkeypatch.setattr(WeightSync, "deliver", publish_with_fault)
    killer = threading.Thread(target=faults.kill_first_server, daemon=True)
    killer.start()
    fired = faults.guard()
    try:
        run_train(config, grader=faulty_grader)
    except BaseException as exc:
        if fired:
            raise AssertionError(f"{fired[0]}; its servers were killed to end it") from exc
        raise
    finally:
        faults.finished.set()
        killer.join(timeout=5)
        for pid in faults.stopped:
            end_for_good(pid)  # never leave a stopped process behind
    assert not fired, fired
    assert len(faults.done) == 2, faults.done

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
