"""One key per launched server and per restart (docs/security.md, "A key per server"), tried
as someone who took the key of one server would: the key a launched server received, read
from its environment as a test can (``/proc/<pid>/environ``), is refused (401, and no proof
of it at ``/health``) by the other server of the same run and by the restarted incarnation
of the same server, and the run key itself reaches no server. The run still trains through
a restart with the broadcast transport (its transfer group's secret is no server's key)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx

from relayrl.config.loader import load_config
from relayrl.launch.backends import RolloutBackend, make_backend
from relayrl.launch.servers import UNPROVEN, UP, ServerLauncher, health_state
from relayrl.runkey import API_KEY_ENV, server_key, transfer_secret
from relayrl.train.run import run_train
from tests.train.conftest import rl_config

RUN_LIMIT_S = 180  # a restart check that never comes fails the test instead of hanging it


def received_key(pid: int) -> str | None:
    """The key server process ``pid`` was started with: its initial environment's
    ``RELAYRL_API_KEY`` (the server drops it from ``os.environ``, not from this view)."""
    for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        name, _, value = entry.decode(errors="replace").partition("=")
        if name == API_KEY_ENV:
            return value
    return None


def status_with(url: str, key: str) -> tuple[int, int]:
    """What the server at ``url`` answers a read and a pause carrying ``key``."""
    auth = {"Authorization": f"Bearer {key}"}
    read = httpx.get(url + "/get_model_info", headers=auth, timeout=30).status_code
    pause = httpx.post(
        url + "/pause_generation", json={"mode": "abort"}, headers=auth, timeout=30
    ).status_code
    return read, pause


def refuses(url: str, key: str) -> bool:
    """Whether the server at ``url`` refuses ``key`` (401 on a read and on a pause) and
    cannot prove that it holds it."""
    return status_with(url, key) == (401, 401) and health_state(url, key) == UNPROVEN


def accepts(url: str, key: str) -> bool:
    """Whether ``key`` reads from the server at ``url`` and the server proves it holds it
    (nothing is changed: a pause is not sent with a key that works)."""
    auth = {"Authorization": f"Bearer {key}"}
    answer = httpx.get(url + "/get_model_info", headers=auth, timeout=30)
    return answer.status_code == 200 and health_state(url, key) == UP


def test_the_derivation_is_one_key_per_server_and_incarnation():
    run_key = "r" * 43
    keys = {server_key(run_key, i, j) for i in range(3) for j in range(3)}
    assert len(keys) == 9 and run_key not in keys
    assert server_key(run_key, 1, 2) == server_key(run_key, 1, 2)  # the launcher recomputes it
    assert server_key("s" * 43, 1, 2) != server_key(run_key, 1, 2)  # another run's
    assert transfer_secret(run_key) not in keys


def test_a_key_taken_from_one_server_opens_neither_the_other_nor_its_restart(
    tiny_model_dir, tmp_path
):
    config = load_config(
        None, [f"model.path={tiny_model_dir}", "model.max_context=64", "rollout.num_servers=2"]
    )
    backend = make_backend(config, tiny_model_dir)
    with backend.launcher(tmp_path) as launcher:
        assert isinstance(launcher, ServerLauncher)
        run_key = backend.api_key
        taken = [received_key(pid) for pid in launcher.pids]
        assert taken == [launcher.key_of(0), launcher.key_of(1)]
        assert run_key and run_key not in taken and len(set(taken)) == 2
        assert refuses(launcher.urls[1], taken[0]) and refuses(launcher.urls[0], taken[1])
        assert accepts(launcher.urls[0], taken[0]) and accepts(launcher.urls[1], taken[1])

        launcher.respawn(0)  # what the supervisor does to a dead or hung server
        launcher.wait_healthy([0])
        restarted = received_key(launcher.pids[0])
        assert restarted == launcher.key_of(0) and restarted not in (*taken, run_key)
        assert refuses(launcher.urls[0], taken[0])  # the old incarnation's key
        assert refuses(launcher.urls[0], taken[1]) and refuses(launcher.urls[1], restarted)
        assert accepts(launcher.urls[0], restarted)

        async def generate_on_each() -> list[int]:
            async with backend.client(launcher.urls) as client:
                assert client.key_for(launcher.urls[0]) == restarted
                params = {"max_new_tokens": 2, "ignore_eos": True}
                outs = [await client.generate([5, 6], params, key=str(i)) for i in range(4)]
                return sorted({o.server for o in outs if len(o.output_ids) == 2})

        assert asyncio.run(generate_on_each()) == sorted(launcher.urls)


class LeakedKeys:
    """From a thread, as from outside: after the run's first step, take server 0's key
    from its environment and kill -9 it; once its replacement proves its own key, try
    every server's key on the others (``checks``). The run's servers are not stopped while
    the checks talk to them (:meth:`hold_stop`): a fast run would otherwise end mid-check."""

    def __init__(self, run: Path, launched: list[ServerLauncher]) -> None:
        self.run, self.launched = run, launched
        self.checks: dict[str, bool] = {}
        self.finished = threading.Event()  # the run is over: stop waiting
        self.done = threading.Event()  # the thread has finished (checked, or given up)
        self.error: BaseException | None = None

    def hold_stop(self, launcher: ServerLauncher) -> None:
        """Make ``launcher.stop`` end any wait of this thread, then wait for its checks."""
        stop = launcher.stop

        def stop_after_the_checks() -> None:
            self.finished.set()
            self.done.wait(RUN_LIMIT_S)
            stop()

        launcher.stop = stop_after_the_checks

    def steps(self) -> int:
        try:
            return (self.run / "metrics.jsonl").read_text().count("\n")
        except OSError:
            return 0

    def wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + RUN_LIMIT_S
        while not ready():
            if self.finished.wait(0.05) or time.monotonic() > deadline:
                raise TimeoutError(f"gave up waiting for {what}")

    def __call__(self) -> None:
        try:
            self.wait(lambda: self.launched and self.steps() >= 1, "the first step")
            launcher = self.launched[0]
            old_url, (pid0, pid1) = launcher.urls[0], launcher.pids
            taken, other = received_key(pid0), received_key(pid1)
            assert taken and other
            os.kill(pid0, signal.SIGKILL)
            self.wait(
                lambda: (
                    launcher.urls[0] != old_url
                    and health_state(launcher.urls[0], launcher.key_of(0)) == UP
                ),
                "the restarted server",
            )
            restarted = received_key(launcher.pids[0])
            assert restarted
            new0, url1 = launcher.urls[0], launcher.urls[1]
            self.checks = {
                "taken key refused by the other server": refuses(url1, taken),
                "taken key refused by its restart": refuses(new0, taken),
                "other server's key refused by the restart": refuses(new0, other),
                "restart's key refused by the other server": refuses(url1, restarted),
                "each server takes its own key": accepts(new0, restarted) and accepts(url1, other),
                "no server received the run key": launcher.spec.api_key
                not in (taken, other, restarted),
            }
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            self.done.set()


def test_a_run_trains_through_a_restart_with_a_key_per_server(
    tmp_path, tiny_model_dir, monkeypatch
):
    steps = 6
    config = rl_config(
        tmp_path,
        tiny_model_dir,
        "rollout.server_mode=process",
        "rollout.num_servers=2",
        "rollout.eta=1",
        "train.weight_transport=broadcast",
        "train.broadcast_timeout_s=30",
        f"train.total_steps={steps}",
        "train.save_final=false",
        "rollout.max_server_restarts=2",
    )
    launched: list[ServerLauncher] = []
    launch = RolloutBackend.launcher

    def recording(self, run_dir):
        launcher = launch(self, run_dir)
        leak.hold_stop(launcher)
        launched.append(launcher)
        return launcher

    leak = LeakedKeys(tmp_path / "run", launched)
    monkeypatch.setattr(RolloutBackend, "launcher", recording)
    thread = threading.Thread(target=leak, daemon=True)
    thread.start()
    try:
        result = run_train(config)
    finally:
        leak.finished.set()
        thread.join(timeout=30)
    assert leak.error is None, repr(leak.error)
    assert leak.checks and all(leak.checks.values()), leak.checks
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if not r.get("final")][-1]
    assert last["step"] == steps and last["server_restarts"] == 1, last
    # the transfer group re-formed after the restart, with the replacement in it
    assert result.summary["transfer_groups"] >= 2, result.summary
