"""``launcher=ray`` starts built-in servers on a node's own, non-loopback address (issue 36:
they refused to start there without a key, and the launcher had none), and those servers
refuse the control plane to anyone without the run's key.

A one-node Ray cluster in a private network namespace whose node address is 10.77.0.1 (on the
namespace's loopback interface: nothing leaves it), as tests/launch/test_ray_launcher.py
builds its two-node one; the launcher runs inside the namespace."""

from __future__ import annotations

import json
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.launch._ray_namespace import RAY, Cluster, namespace_cluster, needs_namespace

pytestmark = needs_namespace
ray = pytest.importorskip("ray")


NODE_IP = "10.77.0.1"
PORT = 6381


@pytest.fixture(scope="module")
def node_cluster() -> Iterator[Cluster]:
    temp = Path(tempfile.mkdtemp(prefix="rr-rayip-", dir="/tmp"))
    script = textwrap.dedent(
        f"""
        set -e
        ip link set lo up
        ip addr add {NODE_IP}/32 dev lo
        unset RAY_ADDRESS
        {RAY} start --head --port={PORT} --num-cpus=2 --include-dashboard=false \\
            --temp-dir={temp} --node-ip-address={NODE_IP} --disable-usage-stats >/dev/null
        echo ready
        exec sleep infinity
        """
    )
    with namespace_cluster(script, temp) as handle:
        yield handle


LAUNCH = """
import asyncio, json, sys
from pathlib import Path
import httpx
from relayrl.config.loader import load_config
from relayrl.launch.backends import make_backend

model, out, address = sys.argv[1:4]
config = load_config(None, [f"model.path={model}", "model.max_context=64", "launcher=ray",
    f"ray.address={address}", "rollout.startup_timeout_s=300"])
backend = make_backend(config, model)
with backend.launcher(Path(out)) as launcher:
    url = launcher.urls[0]
    body = {"model_path": out, "weight_version": 7}
    unauth = httpx.post(url + "/update_weights_from_disk", json=body, timeout=60).status_code

    async def generate():
        async with backend.client(launcher.urls) as client:
            result = await client.generate([5, 6], {"max_new_tokens": 2, "ignore_eos": True})
            return len(result.output_ids), (await client.model_info())[0]["weight_version"]

    tokens, version = asyncio.run(generate())
    argv = Path(f"/proc/{launcher.pids[0]}/cmdline").read_bytes().decode(errors="replace")
    print(json.dumps({"url": url, "unauth": unauth, "tokens": tokens, "version": version,
                      "key_in_argv": backend.api_key in argv or launcher.key_of(0) in argv}))
"""


def test_builtin_servers_start_on_a_node_address_and_need_the_run_key(
    node_cluster, tiny_model_dir, tmp_path
):
    args = [sys.executable, "-c", LAUNCH, str(tiny_model_dir), str(tmp_path), f"{NODE_IP}:{PORT}"]
    done = node_cluster.run(" ".join(f"'{a}'" for a in args), timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["url"].startswith(f"http://{NODE_IP}:")  # bound to the node's address
    assert result["unauth"] == 401  # refused without the run key
    assert (result["tokens"], result["version"]) == (2, 0)  # the run's own client works
    assert result["key_in_argv"] is False
