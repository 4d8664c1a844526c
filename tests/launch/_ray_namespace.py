"""A Ray cluster in a private network namespace, for the Ray launcher tests
(tests/launch/test_ray_launcher.py: two nodes on the namespace's loopback;
tests/launch/test_ray_node_address.py: one node on a non-loopback address).

A holder process (``unshare --net``) runs the script that starts the nodes, prints
``ready`` and keeps the namespace; each run enters it with ``nsenter``. The namespace shares
the pid space, so teardown ends exactly the processes inside it (by pid, never ``ray
stop``, which kills every Ray process of the machine)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
# a test module's mark: the namespace needs root and these tools
needs_namespace = pytest.mark.skipif(
    os.geteuid() != 0 or any(shutil.which(tool) is None for tool in ("unshare", "nsenter", "ip")),
    reason="needs root, unshare, nsenter and ip for a private network namespace",
)


@dataclass
class Cluster:
    """A two-node Ray cluster inside the network namespace of process ``holder``."""

    holder: subprocess.Popen
    namespace: str = ""  # its /proc/PID/ns/net link, read once the cluster is up

    def command(self, script: str) -> list[str]:
        return ["nsenter", "-t", str(self.holder.pid), "-n", "bash", "-c", script]

    def run(self, script: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.command(script), capture_output=True, text=True, timeout=timeout,
            env=cluster_env(),
        )  # fmt: skip

    def popen(self, script: str) -> subprocess.Popen:
        return subprocess.Popen(
            self.command(script), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=cluster_env(),
        )  # fmt: skip

    def pids(self) -> list[int]:
        """Every process in the namespace (the holder, Ray's daemons and workers, runs)."""
        if not self.namespace:
            return []
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if os.readlink(entry / "ns" / "net") == self.namespace:
                        found.append(int(entry.name))
        return found

    def stop(self) -> None:
        """SIGTERM every process in the namespace, SIGKILL what is left after 5 s."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self.pids()
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + 5
            while any(map(alive, pids)) and time.monotonic() < deadline:
                self.holder.poll()  # reap our own child
                time.sleep(0.1)
        self.holder.wait(timeout=5)


def cluster_env() -> dict[str, str]:
    """The environment of the cluster's nodes and of the runs in its namespace: this
    checkout importable, no ``RAY_ADDRESS``, and Ray's token authentication off for all of
    them alike. Ray 2.60 turns it on for ``ray start`` whenever ``~/.ray/auth_token``
    exists (a local ``ray.init`` elsewhere creates one), and then its own worker nodes
    fail to join as unauthenticated: the suite must not depend on that file. The cluster is
    in a private, loopback-only network namespace."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    return env


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@contextlib.contextmanager
def namespace_cluster(script: str, temp: Path, timeout_s: float = 180) -> Iterator[Cluster]:
    """Run ``script`` (it must print ``ready`` once its nodes are up, then hold) in a new
    network namespace; yield the :class:`Cluster` once ready; stop it and remove ``temp``."""
    log = temp / "cluster.log"  # a file: Ray's daemons inherit it and outlive the script
    with open(log, "w") as out:
        holder = subprocess.Popen(
            ["unshare", "--net", "bash", "-c", script],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=cluster_env(),
        )
    handle = Cluster(holder)
    try:
        deadline = time.monotonic() + timeout_s
        ours = os.readlink("/proc/self/ns/net")
        while "ready" not in log.read_text().splitlines():
            with contextlib.suppress(OSError):
                theirs = os.readlink(f"/proc/{holder.pid}/ns/net")
                handle.namespace = theirs if theirs != ours else ""
            if holder.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the Ray cluster did not start: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield handle
    finally:
        handle.stop()
        shutil.rmtree(temp, ignore_errors=True)
