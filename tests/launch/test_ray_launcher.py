"""``launcher: ray`` on a real Ray cluster of two nodes (a head and a worker node, each a
``ray start`` process tree) started by the test.

The cluster and the run live in a private network namespace with only a loopback
interface (``unshare --net``, root): Ray advertises a node's routable address, and there it
can only be 127.0.0.1, so no traffic leaves loopback. The namespace shares the pid space,
so the test kills a server's actor from outside with SIGKILL, as the OOM killer would.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None,
    reason="needs root, unshare and ip for a loopback-only network namespace",
)
ray = pytest.importorskip("ray")
RAY = str(Path(sys.executable).with_name("ray"))
PORT = 6380  # inside the fresh namespace every port is free
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "async.yaml"


def cluster_script(temp: Path, run: str) -> str:
    """Start a head and a worker node (session files under ``temp``, which must be short:
    Ray's unix socket paths stay under 108 bytes), run ``run``, stop the cluster whatever
    happens."""
    common = "--node-ip-address=127.0.0.1 --disable-usage-stats"
    return textwrap.dedent(
        f"""
        set -e
        ip link set lo up
        unset RAY_ADDRESS
        trap '{RAY} stop --force >/dev/null 2>&1' EXIT
        {RAY} start --head --port={PORT} --num-cpus=1 --resources='{{"node_a": 1}}' \\
            --include-dashboard=false --temp-dir={temp} {common} >/dev/null
        {RAY} start --address=127.0.0.1:{PORT} --num-cpus=1 --resources='{{"node_b": 1}}' \\
            {common} >/dev/null
        {run}
        """
    )


def train_command(model_dir: Path, out: Path, *overrides: str) -> str:
    args = [
        sys.executable, "-m", "relayrl.cli", "train", str(CONFIG),
        f"output_dir={out}", "name=run", f"model.path={model_dir}",
        "model.max_context=128", "rollout.prompts_per_step=2", "rollout.n_samples=4",
        "rollout.max_new_tokens=16", "algo.dynamic_sampling=false", "train.eval_every=0",
        "train.progress=false", "eval.num_problems=4", "eval.max_new_tokens=16",
        "train.trainer_threads=1", "runtime.threads=1", "launcher=ray",
        f"ray.address=127.0.0.1:{PORT}", *overrides,
    ]  # fmt: skip
    return " ".join(f"'{a}'" for a in args)


def test_servers_land_where_placed_and_a_killed_actor_is_survived(tiny_model_dir, tmp_path):
    """Two servers, STRICT_SPREAD over two nodes: one per node (cluster.json). Server 0's
    actor is SIGKILLed after the first step: the supervisor respawns it in its bundle and
    the run finishes every step. Then a bundle no node can hold fails in bounded time with
    one error naming the role and the resources."""
    out = tmp_path / "out"
    run = train_command(
        tiny_model_dir,
        out,
        "rollout.num_servers=2",
        "ray.placement_strategy=STRICT_SPREAD",
        "train.total_steps=8",
    )
    too_big = train_command(
        tiny_model_dir, out, "name=big", "ray.server_cpus=4", "ray.placement_timeout_s=5"
    )
    temp = Path(tempfile.mkdtemp(prefix="rr-ray-", dir="/tmp"))
    script = cluster_script(temp, f"{run}\n{too_big} 2> {tmp_path / 'big.err'} || true")
    proc = subprocess.Popen(
        ["unshare", "--net", "bash", "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run_dir = out / "run"
    killed = None
    try:
        deadline = time.monotonic() + 400
        while killed is None and proc.poll() is None and time.monotonic() < deadline:
            metrics = run_dir / "metrics.jsonl"
            if (run_dir / "cluster.json").exists() and metrics.exists():
                if any('"step": 1' in line for line in metrics.read_text().splitlines()):
                    cluster = json.loads((run_dir / "cluster.json").read_text())
                    killed = cluster["servers"][0]["actor_pid"]
                    os.kill(killed, signal.SIGKILL)
            time.sleep(0.2)
        output, _ = proc.communicate(timeout=max(10, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(temp, ignore_errors=True)
    assert proc.returncode == 0, output[-3000:]
    assert killed is not None, "the run ended before its first step was logged"
    assert "final_pass@1=" in output

    cluster = json.loads((run_dir / "cluster.json").read_text())
    nodes = {s["node_id"] for s in cluster["servers"]}
    assert len(cluster["servers"]) == 2 and len(nodes) == 2  # one server per node
    assert cluster["servers"][0]["actor_pid"] != killed  # respawned: a new actor
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train_tokens" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert max(r.get("server_restarts", 0) for r in steps) >= 1

    err = (tmp_path / "big.err").read_text().strip().splitlines()
    assert err[-1].startswith("error: Ray could not place the rollout servers: 1 × {'CPU': 4.0}")
