"""``launcher: ray`` on a local cluster: Ray's auth token (``~/.ray/auth_token``) is 0600
and ``~/.ray`` 0700. Before: Ray wrote it with the umask (0644), and another user who read
it had full access to the cluster's object store."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[2]
START = """
import ray
from relayrl.config.schema import RayConfig
from relayrl.launch.ray_cluster import connect
connect(RayConfig())
print("token-auth", ray._raylet.get_authentication_mode(), flush=True)
ray.shutdown()
"""


def test_a_local_clusters_token_is_private(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(tmp_path), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", START], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=240, umask=0o022,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    token = tmp_path / ".ray" / "auth_token"
    assert token.read_text().strip()
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700
