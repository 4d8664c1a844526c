"""``launcher: ray`` on a real Ray cluster of two nodes (a head and a worker node, each a
``ray start`` process tree) started once for this module.

The cluster and the runs live in a private network namespace with only a loopback
interface (``unshare --net``, root): Ray advertises a node's routable address, and there it
can only be 127.0.0.1, so no traffic leaves loopback. A holder process keeps the namespace;
each run enters it with ``nsenter``. The namespace shares the pid space, so a test kills a
server's actor from outside with SIGKILL, as the OOM killer would; teardown ends exactly the
processes inside the namespace (by pid, never ``ray stop``, which kills every Ray process
of the machine).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from relayrl.report.logs import read_jsonl
from tests.launch._ray_namespace import RAY, Cluster, namespace_cluster, needs_namespace

pytestmark = needs_namespace
ray = pytest.importorskip("ray")
PORT = 6380  # inside the fresh namespace every port is free
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "async.yaml"


def cluster_script(temp: Path) -> str:
    """Start a head and a worker node (session files under ``temp``, which must be short:
    Ray's unix socket paths stay under 108 bytes), say ``ready``, then hold the namespace."""
    common = "--node-ip-address=127.0.0.1 --disable-usage-stats"
    return textwrap.dedent(
        f"""
        set -e
        ip link set lo up
        unset RAY_ADDRESS
        {RAY} start --head --port={PORT} --num-cpus=1 --resources='{{"node_a": 1}}' \\
            --include-dashboard=false --temp-dir={temp} {common} >/dev/null
        {RAY} start --address=127.0.0.1:{PORT} --num-cpus=1 --resources='{{"node_b": 1}}' \\
            {common} >/dev/null
        echo ready
        exec sleep infinity
        """
    )


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    temp = Path(tempfile.mkdtemp(prefix="rr-ray-", dir="/tmp"))
    with namespace_cluster(cluster_script(temp), temp) as handle:
        yield handle


def train_args(model_dir: Path, out: Path, *overrides: str) -> list[str]:
    return [
        sys.executable, "-m", "relayrl.cli", "train", str(CONFIG),
        f"output_dir={out}", "name=run", f"model.path={model_dir}",
        "model.max_context=128", "rollout.prompts_per_step=2", "rollout.n_samples=4",
        "rollout.max_new_tokens=16", "algo.dynamic_sampling=false", "train.eval_every=0",
        "train.progress=false", "eval.num_problems=4", "eval.max_new_tokens=16",
        "train.trainer_threads=1", "runtime.threads=1", "launcher=ray",
        "rollout.startup_timeout_s=300",  # a loaded machine starts an actor slowly (120 s seen)
        f"ray.address=127.0.0.1:{PORT}", *overrides,
    ]  # fmt: skip


def shell(args: list[str]) -> str:
    return " ".join(f"'{a}'" for a in args)


def test_servers_land_where_placed_and_a_killed_actor_is_survived(
    cluster, tiny_model_dir, tmp_path
):
    """Two servers, STRICT_SPREAD over two nodes: one per node (cluster.json). Server 0's
    actor is SIGKILLed after the first step: the supervisor respawns it in its bundle and
    the run finishes every step. Then a bundle no node can hold fails in bounded time with
    one error naming the role and the resources."""
    out = tmp_path / "out"
    run = train_args(
        tiny_model_dir,
        out,
        "rollout.num_servers=2",
        "ray.placement_strategy=STRICT_SPREAD",
        "train.total_steps=8",
    )
    too_big = train_args(
        tiny_model_dir, out, "name=big", "ray.server_cpus=4", "ray.placement_timeout_s=5"
    )
    proc = cluster.popen(f"{shell(run)}\n{shell(too_big)} 2> {tmp_path / 'big.err'} || true")
    run_dir = out / "run"
    killed = None
    try:
        deadline = time.monotonic() + 400
        while killed is None and proc.poll() is None and time.monotonic() < deadline:
            metrics = run_dir / "metrics.jsonl"
            if (run_dir / "cluster.json").exists() and metrics.exists():
                if any('"step": 1' in line for line in metrics.read_text().splitlines()):
                    info = json.loads((run_dir / "cluster.json").read_text())
                    killed = info["servers"][0]["actor_pid"]
                    os.kill(killed, signal.SIGKILL)
            time.sleep(0.2)
        output, _ = proc.communicate(timeout=max(10, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    assert killed is not None, "the run ended before its first step was logged"
    assert "final_pass@1=" in output

    info = json.loads((run_dir / "cluster.json").read_text())
    nodes = {s["node_id"] for s in info["servers"]}
    assert len(info["servers"]) == 2 and len(nodes) == 2  # one server per node
    assert info["servers"][0]["actor_pid"] != killed  # respawned: a new actor
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train_tokens" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert max(r.get("server_restarts", 0) for r in steps) >= 1
    # the dashboard's view: both nodes on every row, each with the restarts since the row
    # before (a respawn may begin and end between two rows, so no row need see the server
    # down: the restart count is what every row must show). The run may end before the
    # respawned actor answers /health, so the last row need not show it up again.
    restarted = r"(\d+) restarted"
    node = (
        rf"\w{{6}}@127\.0\.0\.1 (?:1/1 up(?: \({restarted}\))?"
        rf"|0/1 up \(1 (?:unanswered|restarting|down)(?:, {restarted})?\))"
    )
    before = 0
    for row in steps:
        seen = re.fullmatch(f"{node}, {node}", row["servers"])
        assert seen, row["servers"]
        shown = sum(int(n) for n in seen.groups() if n is not None)
        assert shown == row["server_restarts"] - before, (row["servers"], before)
        before = row["server_restarts"]
    assert any("restarted" in r["servers"] for r in steps)
    assert all(r["servers_total"] == 2 and r["servers_up"] >= 1 for r in steps)

    err = (tmp_path / "big.err").read_text().strip().splitlines()
    assert err[-1].startswith("error: Ray could not place the rollout servers: 1 × {'CPU': 4.0}")


def trajectories(run_dir: Path) -> list[dict]:
    """The trained trajectories of a run in (step, group, sample) order, in full (token
    ids, behaviour logprobs, versions, reward, advantage) but for their timings."""
    rows = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    rows.sort(key=lambda r: (r["step"], int(r["group_id"][1:]), r["sample_index"]))
    return [
        {"step": r["step"], **{k: v for k, v in r["trajectory"].items() if k != "timings"}}
        for r in rows
    ]  # timings: wall-clock seconds, the one field that may differ


PARITY_RUN = (
    "import sys; from relayrl.config.loader import load_config; "
    "from relayrl.train.run import run_train; from tests.train.conftest import parity_grader; "
    "run_train(load_config(sys.argv[1], sys.argv[2:]), grader=parity_grader)"
)


def graded(args: list[str]) -> list[str]:
    """``relayrl train`` ``args`` run through ``run_train`` with the parity grader (varied
    rewards on a random model, so the updates are real; a task's verifier gives all zeros)."""
    config_and_overrides = args[args.index("train") + 1 :]
    return [sys.executable, "-c", PARITY_RUN, *config_and_overrides]


# 50 s; the world-size-2 test below compares the same (trajectories and weights, local vs
# ray) with a trainer rank on the cluster too: `pytest -m benchmark` runs this one
@pytest.mark.benchmark
def test_local_and_ray_launchers_train_the_same_batches_at_eta0(cluster, tiny_model_dir, tmp_path):
    """η = 0, one request at a time per server (the engine's batch composition is the one
    source of last-bit differences, docs/engine.md): the launcher only decides where the
    server process runs, so both runs must train the same prompts, the same completion
    token ids with the same behaviour logprobs, rewards and advantages, and end with
    bitwise the same weights."""
    common = (
        "rollout.eta=0", "rollout.max_running_requests=1", "train.total_steps=3",
        "train.dump_trajectories=true", "train.save_final=true", "optim.lr=1e-4",
    )  # fmt: skip
    local = graded(train_args(tiny_model_dir, tmp_path, "name=local", *common, "launcher=local"))
    on_ray = graded(train_args(tiny_model_dir, tmp_path, "name=ray", *common))
    done = cluster.run(f"{shell(local)} && {shell(on_ray)}", timeout=540)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert (tmp_path / "ray" / "cluster.json").is_file()  # the servers were Ray actors
    assert not (tmp_path / "local" / "cluster.json").exists()

    a, b = trajectories(tmp_path / "local"), trajectories(tmp_path / "ray")
    assert len(a) == 3 * 2 * 4 and [t["step"] for t in a] == [t["step"] for t in b]
    assert a == b  # prompts, completion ids, logprobs, versions, rewards, advantages
    assert all(set(t["versions"]) == {t["step"]} for t in a)  # η = 0: on-policy
    assert len({t["reward"] for t in a}) == 2  # rewards vary: real updates

    from relayrl.models.loading import load_model

    w_local = dict(load_model(tmp_path / "local" / "final_model").named_parameters())
    w_ray = load_model(tmp_path / "ray" / "final_model").named_parameters()
    w_init = dict(load_model(tiny_model_dir).named_parameters())
    assert max((p - w_init[n]).abs().max().item() for n, p in w_local.items()) > 1e-5  # trained
    assert all(bool((p == w_local[n]).all()) for n, p in w_ray)  # bitwise


# 50 s (80 s under `make test`'s two workers); the local world-size-2 runs of
# tests/train/test_fsdp.py give the same update as world size 1, and the servers' test above
# runs Ray actors of this launcher: `pytest -m benchmark` runs this one
@pytest.mark.benchmark
def test_trainer_rank_1_runs_as_a_ray_actor_and_trains_as_the_local_rank_does(
    cluster, tiny_model_dir, tmp_path
):
    """``train.world_size=2``, η = 0, one request at a time: with ``launcher=ray`` rank 1 is
    a Ray actor on the cluster (cluster.json, its log) that rendezvouses with rank 0 over
    gloo at rank 0's node address; the run trains the same batches (so the servers got the
    same published weights: at η = 0 each step's behaviour logprobs come from the weights
    published after the step before) and ends with bitwise the weights of the same run with
    rank 1 as a local subprocess, and the same held-out figure."""
    common = (
        "rollout.eta=0", "rollout.max_running_requests=1", "train.total_steps=2",
        "train.dump_trajectories=true", "train.save_final=true", "optim.lr=1e-4",
        "train.world_size=2", "train.dist_timeout_s=300",  # rank start-up on a loaded host
    )  # fmt: skip
    local = graded(train_args(tiny_model_dir, tmp_path, "name=local", *common, "launcher=local"))
    on_ray = graded(train_args(tiny_model_dir, tmp_path, "name=ray", *common))
    done = cluster.run(f"{shell(local)} && {shell(on_ray)}", timeout=580)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    finals = [
        json.loads((tmp_path / name / "train_summary.json").read_text())["final_pass@1"]
        for name in ("local", "ray")
    ]
    assert finals[0] is not None and finals[0] == finals[1]  # the same held-out figure

    info = json.loads((tmp_path / "ray" / "cluster.json").read_text())
    assert [r["rank"] for r in info["trainer_ranks"]] == [1] and len(info["servers"]) == 1
    rank1 = info["trainer_ranks"][0]
    nodes = {n["NodeID"] for n in ray_nodes(cluster, tmp_path)}
    assert rank1["node_id"] in nodes and rank1["node_ip"] == "127.0.0.1"
    assert rank1["log"] == str(tmp_path / "ray" / "trainer-rank1.log")
    log = Path(rank1["log"]).read_text()
    assert f"trainer rank 1/2 ready (gloo, pid {rank1['pid']})" in log  # the worker entry point
    assert not (tmp_path / "local" / "cluster.json").exists()

    a, b = trajectories(tmp_path / "local"), trajectories(tmp_path / "ray")
    assert len(a) == 2 * 2 * 4 and a == b
    assert len({t["reward"] for t in a}) == 2  # rewards vary: real updates

    from relayrl.models.loading import load_model

    w_local = dict(load_model(tmp_path / "local" / "final_model").named_parameters())
    w_init = dict(load_model(tiny_model_dir).named_parameters())
    assert max((p - w_init[n]).abs().max().item() for n, p in w_local.items()) > 1e-5
    w_ray = load_model(tmp_path / "ray" / "final_model").named_parameters()
    assert all(bool((p == w_local[n]).all()) for n, p in w_ray)  # bitwise


def ray_nodes(cluster: Cluster, tmp_path: Path) -> list[dict]:
    """``ray.nodes()`` of the test's cluster, read from inside its namespace."""
    script = tmp_path / "nodes.py"
    script.write_text(
        f"import json, ray\nray.init(address='127.0.0.1:{PORT}', log_to_driver=False)\n"
        "print(json.dumps([{'NodeID': n['NodeID'], 'Alive': n['Alive']} for n in ray.nodes()]))\n"
    )
    done = cluster.run(shell([sys.executable, str(script)]), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# 53 s; the local launcher's killed-rank test (tests/train/test_fsdp.py) covers the same
# stop-and-resume path in the 15-minute suite: `pytest -m benchmark` runs this one
@pytest.mark.benchmark
def test_a_killed_trainer_rank_actor_stops_the_run_naming_it_and_resume_continues(
    cluster, tiny_model_dir, tmp_path
):
    """``train.world_size=2`` on Ray: rank 1's actor gets SIGKILL after the second
    checkpoint (its worker dies with it): one error line naming rank 1, its pid and node, and
    ``--resume``; the resumed run (rank 1 again an actor) trains every step, every sample once."""
    steps = 5
    run = train_args(
        tiny_model_dir, tmp_path, "train.world_size=2", f"train.total_steps={steps}",
        "train.checkpoint_every=1", "train.dist_timeout_s=300",
    )  # fmt: skip
    run_dir = tmp_path / "run"
    proc = cluster.popen(f"{shell(run)} 2> {tmp_path / 'err.txt'}")
    rank1 = None
    try:
        deadline = time.monotonic() + 400
        while proc.poll() is None and time.monotonic() < deadline:
            if (run_dir / "checkpoints" / "step-000002").is_dir():
                rank1 = json.loads((run_dir / "cluster.json").read_text())["trainer_ranks"][0]
                os.kill(rank1["actor_pid"], signal.SIGKILL)
                break
            time.sleep(0.1)
        output, _ = proc.communicate(timeout=max(60, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rank1 is not None, output[-3000:]
    errors = [
        ln for ln in (tmp_path / "err.txt").read_text().splitlines() if ln.startswith("error:")
    ]
    assert proc.returncode != 0 and len(errors) == 1, output[-3000:]
    assert errors[0].startswith(
        f"error: trainer rank 1 (pid {rank1['pid']} on Ray node 127.0.0.1) died (killed by SIGKILL)"
    ), errors[0]
    assert f"--resume {run_dir}" in errors[0]

    resumed = cluster.run(
        shell([sys.executable, "-m", "relayrl.cli", "train", "--resume", str(run_dir)])
    )
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    again = json.loads((run_dir / "cluster.json").read_text())["trainer_ranks"][0]
    assert again["actor_pid"] != rank1["actor_pid"]  # a fresh actor
    trained = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "train_tokens" in r]
    assert [r["step"] for r in trained] == list(range(1, steps + 1))
    samples = read_jsonl(run_dir / "samples.jsonl")
    keys = [(r["group_id"], r["sample_index"]) for r in samples]
    assert len(keys) == len(set(keys)) == steps * 2 * 4  # every sample once, none lost


def metadata_script(ray_version: str | None) -> str:
    """Rewrite (or, with None, restore) the Ray version the cluster's GCS records."""
    code = textwrap.dedent(
        f"""
        import json, ray
        from ray._raylet import GcsClient
        from relayrl.launch.ray_cluster import CLUSTER_METADATA_KEY as K, CLUSTER_NAMESPACE as N
        gcs = GcsClient(address="127.0.0.1:{PORT}")
        meta = json.loads(gcs.internal_kv_get(K, namespace=N, timeout=10))
        meta["ray_version"] = {json.dumps(ray_version or "")} or ray.__version__
        gcs.internal_kv_put(K, json.dumps(meta).encode(), True, namespace=N, timeout=10)
        """
    )
    return shell([sys.executable, "-c", code])


def test_bad_ray_addresses_fail_with_one_line_in_bounded_time(cluster, tiny_model_dir, tmp_path):
    """A port nobody listens on: one error naming ray.address, the address and what was
    tried, after ray.connect_timeout_s (``ray.init`` alone retries for ever). A cluster whose
    GCS records another Ray version (rewritten here: one Ray is installed) is refused before
    connecting, naming both versions."""
    nobody = train_args(
        tiny_model_dir, tmp_path, "ray.address=127.0.0.1:6999", "ray.connect_timeout_s=3"
    )
    start = time.monotonic()
    done = cluster.run(shell(nobody), timeout=120)
    took = time.monotonic() - start
    assert done.returncode != 0
    err = done.stderr.strip().splitlines()
    assert err[-1].startswith(
        "error: ray.address='127.0.0.1:6999': no Ray head answers at 127.0.0.1:6999: "
    ), done.stderr[-2000:]
    assert "over 3s (ray.connect_timeout_s) failed, last with 'Connection refused'" in err[-1]
    assert took < 60  # 3 s of probing plus the start-up of the CLI

    mismatch = train_args(tiny_model_dir, tmp_path, "name=mismatch")
    done = cluster.run(
        f"{metadata_script('2.40.0')} && {{ {shell(mismatch)}; code=$?; "
        f"{metadata_script(None)}; exit $code; }}",
        timeout=120,
    )
    assert done.returncode != 0
    err = done.stderr.strip().splitlines()
    assert err[-1] == (
        f"error: ray.address='127.0.0.1:{PORT}' (127.0.0.1:{PORT}): version mismatch between "
        f"this driver and the Ray cluster: Ray 2.40.0 there, {ray.__version__} here; every "
        "node and the driver need the same versions (install them into this environment, or "
        "restart the cluster from it)"
    ), done.stderr[-2000:]


def raylet_of(cluster: Cluster, resource: str) -> int:
    """The pid of the raylet of the node started with custom resource ``resource``."""
    for pid in cluster.pids():
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if Path(argv[0].decode()).name == "raylet" and resource.encode() in b" ".join(argv):
                return pid
    raise AssertionError(f"no raylet with {resource} in the namespace")


def driver_pid(cluster: Cluster) -> int:
    """The pid of the `relayrl train` process inside the namespace."""
    for pid in cluster.pids():
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if argv[0].endswith(b"python") and b"relayrl.cli" in argv and b"train" in argv:
                return pid
    raise AssertionError("no relayrl train process in the namespace")


# 39 s; the killed-actor test above covers the respawn-in-its-bundle path in the 15-minute
# suite, this one the loss of a whole node: `pytest -m benchmark` runs it
@pytest.mark.benchmark
def test_a_killed_worker_raylet_is_survived_on_the_other_node(cluster, tiny_model_dir, tmp_path):
    """Two half-CPU servers spread over the two nodes; after the first step the worker
    node's raylet gets SIGKILL (the node is lost, with the server actor on it). Ray takes
    a while to declare the node dead (its health checks), so the run is open-ended and is
    stopped by SIGTERM once the server is back: respawned in its bundle, which Ray re-placed
    on the head node (half a CPU free there), and two more steps trained with it. Every step
    up to the last is trained, every sample once. Runs last: it restarts the worker node
    afterwards."""
    out = tmp_path / "out"
    run = train_args(
        tiny_model_dir, out, "rollout.num_servers=2", "ray.server_cpus=0.5",
        "ray.placement_strategy=SPREAD", "train.total_steps=100000",
    )  # fmt: skip
    proc = cluster.popen(shell(run))
    run_dir, killed, before, after = out / "run", None, None, None
    try:
        deadline = time.monotonic() + 500
        while proc.poll() is None and time.monotonic() < deadline:
            trained = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "train_tokens" in r]
            if killed is None and trained and (run_dir / "cluster.json").exists():
                before = json.loads((run_dir / "cluster.json").read_text())["servers"]
                killed = raylet_of(cluster, "node_b")
                os.kill(killed, signal.SIGKILL)
                killed_at = time.monotonic()
            elif killed is not None and after is None:
                servers = json.loads((run_dir / "cluster.json").read_text())["servers"]
                if len({s["node_id"] for s in servers}) == 1:
                    after, respawned_at = servers, len(trained)
                    print(
                        f"raylet SIGKILL -> server respawned: {time.monotonic() - killed_at:.0f}s"
                    )
            elif after is not None and len(trained) >= respawned_at + 2:
                os.kill(driver_pid(cluster), signal.SIGTERM)  # stops after the step
                break
            time.sleep(0.2)
        output, _ = proc.communicate(timeout=max(60, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
        resources = json.dumps({"node_b": 1})
        cluster.run(
            f"{RAY} start --address=127.0.0.1:{PORT} --num-cpus=1 --resources='{resources}' "
            "--node-ip-address=127.0.0.1 --disable-usage-stats",
            timeout=180,
        )
    assert after is not None, output[-3000:]  # the lost server came back on the head node
    assert proc.returncode == 130 and "interrupted" in output, output[-3000:]  # SIGTERM
    assert len({s["node_id"] for s in before}) == 2  # one server per node before the kill
    assert {s["node_id"] for s in after} <= {s["node_id"] for s in before}
    trained = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "train_tokens" in r]
    steps = [r["step"] for r in trained]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= respawned_at + 2
    assert trained[-1]["server_restarts"] >= 1
    samples = read_jsonl(run_dir / "samples.jsonl")
    keys = [(r["group_id"], r["sample_index"]) for r in samples]
    assert len(keys) == len(set(keys)) == len(steps) * 2 * 4  # every sample once, none lost
