"""A launcher without a log directory (``relayrl eval --config`` on a non-built-in backend,
benchmarks) writes its servers' logs in a private directory of its own, never at a fixed
shared path such as ``/tmp/server-0.log``, where a symlink planted by another user made a
root run truncate the file it pointed to, and two users' evaluations wrote into each
other's logs (issue 43, item 5)."""

from __future__ import annotations

import stat
import tempfile
from pathlib import Path

from relayrl.launch.servers import ServerLauncher, ServerSpec


def test_logs_without_a_log_dir_are_private_and_per_launcher():
    first = ServerLauncher(ServerSpec("model"), 2)
    second = ServerLauncher(ServerSpec("model"), 2)
    a0, a1, b0 = first.log_path(0), first.log_path(1), second.log_path(0)
    assert a0.parent == a1.parent != b0.parent
    assert a0.parent.parent == Path(tempfile.gettempdir())
    assert a0 != Path(tempfile.gettempdir()) / "server-0.log"
    assert stat.S_IMODE(a0.parent.stat().st_mode) == 0o700


def test_a_given_log_dir_is_used_as_is(tmp_path):
    launcher = ServerLauncher(ServerSpec("model"), 1, log_dir=tmp_path)
    assert launcher.log_path(0) == tmp_path / "server-0.log"
