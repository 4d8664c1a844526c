"""Measure ``launcher: ray`` against ``launcher: local`` on this machine, side by side in
one run (docs/cluster.md): Ray cluster start-up, time to the first rollout server ready,
recovery after a server is SIGKILLed (its actor, for Ray), and weight publication latency
of a tiny training run (the Ray run publishes through the run directory, as on a cluster,
so a local run publishing to disk is measured too, besides the default /dev/shm).

Runs as root inside a private network namespace with only loopback (it re-executes itself
under ``unshare --net``), so Ray advertises 127.0.0.1 and nothing leaves the machine; at the
end it kills exactly the processes of that namespace (by pid). Usage:

    PYTHONPATH=$PWD python scripts/bench_ray.py [--quick]

Last line: ``ray_vs_local_publish_ratio=<x>``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
PORT = 6380
COMMON = "--node-ip-address=127.0.0.1 --disable-usage-stats"


def timed(fn) -> tuple[float, object]:
    start = time.monotonic()
    result = fn()
    return time.monotonic() - start, result


def start_cluster(temp: Path) -> float:
    """A head and a worker node, 1 CPU each (as the tests); seconds until both are up."""

    def up() -> None:
        subprocess.run(
            f"{RAY} start --head --port={PORT} --num-cpus=1 --include-dashboard=false "
            f"--temp-dir={temp} {COMMON} >/dev/null 2>&1 && "
            f"{RAY} start --address=127.0.0.1:{PORT} --num-cpus=1 {COMMON} >/dev/null 2>&1",
            shell=True,
            check=True,
        )

    return timed(up)[0]


def launcher_figures(launcher, kill_pid) -> dict[str, float]:
    """Seconds to the first server healthy, then to a replacement healthy after SIGKILL."""
    first, _ = timed(launcher.start)
    os.kill(kill_pid(launcher), signal.SIGKILL)

    def recover() -> None:
        while launcher.exit_code(0) is None:
            time.sleep(0.05)
        launcher.respawn(0)
        launcher.wait_healthy([0])

    recovery, _ = timed(recover)
    launcher.stop()
    return {"first_server_ready_s": first, "recovery_s": recovery}


def publish_latency(model: Path, out: Path, steps: int, *overrides: str) -> float:
    args = [
        sys.executable, "-m", "relayrl.cli", "train", str(ROOT / "configs" / "async.yaml"),
        f"output_dir={out}", f"model.path={model}", "model.max_context=128",
        "rollout.prompts_per_step=2", "rollout.n_samples=4", "rollout.max_new_tokens=16",
        "algo.dynamic_sampling=false", "train.eval_every=0", "train.progress=false",
        "eval.num_problems=4", "eval.max_new_tokens=16", "train.trainer_threads=1",
        "runtime.threads=1", f"train.total_steps={steps}", *overrides,
    ]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, check=True)
    return float(re.search(r"publish_latency_mean_s=([\d.]+)", done.stdout).group(1))


def in_namespace(own: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if os.readlink(entry / "ns" / "net") == own:
                    found.append(int(entry.name))
    return found


def stop_namespace() -> None:
    own = os.readlink("/proc/self/ns/net")
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in in_namespace(own):
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        time.sleep(3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 training steps, not 10")
    opts = parser.parse_args()
    if os.environ.get("RELAYRL_BENCH_NETNS") != "1":
        env = dict(os.environ, RELAYRL_BENCH_NETNS="1")
        env.pop("RAY_ADDRESS", None)
        cmd = ["unshare", "--net", sys.executable, __file__, *sys.argv[1:]]
        sys.exit(subprocess.run(cmd, env=env).returncode)
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)

    import torch

    torch.set_num_threads(1)
    from relayrl.config.schema import RayConfig
    from relayrl.launch.ray_cluster import RayServerLauncher, connect
    from relayrl.launch.servers import ServerLauncher, ServerSpec
    from relayrl.models.build import create_model_dir
    from relayrl.tasks.registry import make_task

    steps = 3 if opts.quick else 10
    temp = Path(tempfile.mkdtemp(prefix="rr-bray-", dir="/tmp"))
    try:
        model = temp / "model"
        create_model_dir(model, make_task("arithmetic"), "tiny", seed=0, corpus_size=500)
        cluster_s = start_cluster(temp / "r")
        spec = ServerSpec(str(model), threads=1)
        local = launcher_figures(
            ServerLauncher(spec, 1, log_dir=temp / "local"), lambda lau: lau.pids[0]
        )
        ray_config = RayConfig(address=f"127.0.0.1:{PORT}")
        connect_s, _ = timed(lambda: connect(ray_config))
        ray = launcher_figures(
            RayServerLauncher(spec, 1, log_dir=temp / "ray", ray_config=ray_config),
            lambda lau: lau._procs[0].info["actor_pid"],
        )
        pub_local = publish_latency(model, temp / "runs", steps, "name=local")
        pub_disk = publish_latency(
            model, temp / "runs", steps, "name=disk", f"train.weights_dir={temp / 'weights'}"
        )  # where the Ray run publishes: the run's filesystem, not /dev/shm
        pub_ray = publish_latency(
            model, temp / "runs", steps, "name=ray", "launcher=ray", f"ray.address=127.0.0.1:{PORT}"
        )
    finally:
        with contextlib.suppress(Exception):
            import ray as ray_module

            ray_module.shutdown()
        stop_namespace()
        subprocess.run(["rm", "-rf", str(temp)], check=False)
    print(f"ray cluster start (head + 1 worker node): {cluster_s:.1f} s")
    print(f"driver connect (ray.init): {connect_s:.1f} s")
    print(f"{'':24} {'local':>8} {'ray':>8} {'ratio':>7}")
    for key in ("first_server_ready_s", "recovery_s"):
        print(f"{key:24} {local[key]:8.2f} {ray[key]:8.2f} {ray[key] / local[key]:7.2f}")
    print(
        f"{'publish_latency_mean_s':24} {pub_local:8.3f} {pub_ray:8.3f} {pub_ray / pub_local:7.2f}"
    )
    print(f"{'  same, local on disk':24} {pub_disk:8.3f} {pub_ray:8.3f} {pub_ray / pub_disk:7.2f}")
    print(f"ray_vs_local_publish_ratio={pub_ray / pub_local:.2f}")


if __name__ == "__main__":
    main()
