"""ServerLauncher processes and the parent-death signal: Linux sends it when the *thread* that
forked the child exits, so a server started or restarted from a short-lived thread (an
``asyncio.to_thread`` worker, say) must not die with that thread; it dies with the launcher's
spawner thread. A stopped (SIGSTOP) server is stopped for good by :meth:`stop`. The
"server" here is a sleeping Python process set up like a real one (no model to load)."""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from relayrl.launch.servers import ServerLauncher, ServerSpec

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")

FAKE_SERVER = (  # what serve_child does before it runs `relayrl serve`
    "import os, time; from relayrl.launch.servers import PARENT_ENV, die_with_parent; "
    "die_with_parent(int(os.environ.pop(PARENT_ENV))); print('ready', flush=True); "
    "time.sleep(120)"
)


@pytest.fixture
def launcher(tmp_path, monkeypatch):
    launcher = ServerLauncher(ServerSpec("unused"), num_servers=0, log_dir=tmp_path)
    monkeypatch.setattr(launcher, "_command", lambda port: [sys.executable, "-c", FAKE_SERVER])
    yield launcher
    launcher.stop()


def in_thread(fn, *args) -> None:
    """Run ``fn(*args)`` in a thread that has exited when this returns."""
    thread = threading.Thread(target=fn, args=args)
    thread.start()
    thread.join()


def wait_ready(launcher: ServerLauncher, i: int, count: int = 1) -> None:
    """Until server ``i`` has set its parent-death signal (it prints 'ready' after)."""
    deadline = time.monotonic() + 30
    while launcher._logs[i].read_text().count("ready") < count:
        assert launcher.exit_code(i) is None, launcher._logs[i].read_text()
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.05)


def start(launcher: ServerLauncher) -> None:
    launcher._start_process(0)
    wait_ready(launcher, 0)


def restart(launcher: ServerLauncher) -> None:
    launcher.respawn(0)
    wait_ready(launcher, 0, count=2)


def test_servers_outlive_the_threads_that_start_and_restart_them(launcher):
    """Each thread exits after its server has set the signal (a server forked by the
    thread itself got SIGTERM right then: exit -15)."""
    in_thread(start, launcher)
    first = launcher._procs[0]
    time.sleep(0.3)
    assert launcher.exit_code(0) is None  # the starting thread is gone, the server is not

    in_thread(restart, launcher)
    assert first.returncode == -signal.SIGKILL
    time.sleep(0.3)
    assert launcher.exit_code(0) is None

    spawner = launcher._spawner
    assert spawner is not None
    spawner.shutdown(wait=True)  # the servers' parent thread exits: they get SIGTERM
    assert launcher._procs[0].wait(timeout=10) == -signal.SIGTERM


def test_stop_ends_a_stopped_server(launcher):
    launcher._start_process(0)
    wait_ready(launcher, 0)
    proc = launcher._procs[0]
    proc.send_signal(signal.SIGSTOP)
    start = time.monotonic()
    launcher.stop()
    assert proc.returncode == -signal.SIGTERM  # SIGCONT let it take the SIGTERM
    assert time.monotonic() - start < 5  # not the 10 s wait before SIGKILL


LITTERING_SERVER = (  # as a vLLM LoRA worker does: a private temporary directory, atexit only
    "import tempfile; from pathlib import Path; "
    "d = Path(tempfile.mkdtemp(prefix='relayrl-base-adapter-')); "
    "(d / 'adapter_config.json').write_text('{}'); print('made', d, flush=True); " + FAKE_SERVER
)


def test_what_a_killed_server_left_in_its_temporary_directory_goes_with_stop(launcher, monkeypatch):
    monkeypatch.setattr(launcher, "_command", lambda port: [sys.executable, "-c", LITTERING_SERVER])
    start(launcher)
    restart(launcher)  # the first incarnation is killed (-9): its atexit never ran
    made = [
        Path(line.split(" ", 1)[1])
        for line in launcher._logs[0].read_text().splitlines()
        if line.startswith("made ")
    ]
    scratch = launcher.scratch_dir()
    assert len(made) == 2 and all(d.parent == scratch and d.is_dir() for d in made), made
    assert scratch.stat().st_mode & 0o777 == 0o700
    launcher.stop()
    assert not scratch.exists() and not any(d.exists() for d in made)


def test_telling_line_picks_the_exception_and_its_detail(tmp_path):
    from relayrl.launch.servers import telling_line

    log = tmp_path / "server-0.log"
    log.write_text(
        "INFO starting\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in <module>\n'
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
        "  Value error, Model architectures ['Nope'] are not supported for now.\n"
        "    For further information visit https://errors.pydantic.dev/2.14/v/value_error\n"
        "INFO shutting down\n"
    )
    assert telling_line(log) == (
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig | "
        "Value error, Model architectures ['Nope'] are not supported for now."
    )
    log.write_text("INFO a\nWARNING b\nOSError: [Errno 98] Address already in use\nINFO c\n")
    assert telling_line(log) == "OSError: [Errno 98] Address already in use"
    log.write_text("INFO a\nINFO last\n")
    assert telling_line(log) == "INFO last"
    assert telling_line(tmp_path / "missing.log") == ""
