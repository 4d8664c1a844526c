"""Rollout servers as Ray actors: ``launcher: ray`` (docs/cluster.md).

Owns: :func:`connect` (``ray.init`` on ``ray.address``, with one clear error for an
unreachable cluster or a Ray version mismatch), :class:`RayServerLauncher` and the actor
classes (a process host per server or trainer rank), and what the trainer ranks' launcher
(relayrl.train.ray_ranks) shares with it: :func:`reserve` (a placement group per role, one
error when it never comes), :func:`await_start` and :func:`update_cluster_file`. The launcher has the local launcher's interface (start, check, kill,
respawn, wait_healthy, describe, stop), so the supervisor, the controller and the trainer
work unchanged; only *where* a server runs differs:

* one placement group for the role "rollout servers": a bundle of ``ray.server_cpus`` CPUs
  (+ ``server_gpus``, ``server_resources``) per server, placed by
  ``ray.placement_strategy``; resources that never come give one error after
  ``ray.placement_timeout_s`` naming the role, the bundle and what the cluster has;
* server ``i`` is an actor in bundle ``i`` that starts the same server command as the local
  launcher (built-in engine or vLLM) as its child, listening on its node's address; the
  child dies with the actor (parent-death signal), so a killed actor never leaves a server;
* the actor is given server ``i``'s spec holding that server's own key
  (``ServerLauncher.spec_for``), never the run key;
* a dead actor reads as an exited server: the supervisor respawns it, a fresh actor in the
  same bundle (on any node with room when its node is gone), and resubmits its requests;
* ``<run>/cluster.json`` lists each server's node, actor pid, server pid, URL and log.

The server logs go to the run directory, as with the local launcher: on several nodes the
run directory must be on a filesystem they share (as it is under Slurm).

Imports: relayrl.launch.servers, relayrl.config (the ray section), relayrl.errors; ``ray``
only when this launcher is used.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from relayrl.config.schema import RayConfig
from relayrl.errors import RelayError
from relayrl.launch.servers import LISTEN_FD_ENV, PARENT_ENV, ServerLauncher, reserve_port

ROLE = "rollout servers"


CLUSTER_METADATA_KEY = b"CLUSTER_METADATA"  # what ``ray start`` records in the GCS
CLUSTER_NAMESPACE = b"cluster"
PROBE_INTERVAL_S = 0.5
VERSION_KEYS = ("ray_version", "python_version", "relayrl_version")


def connect(cfg: RayConfig) -> None:
    """Join (or, for ``address: local``, start) the Ray cluster of this run.

    For a cluster address, every step is bounded and fails with one error naming
    ``ray.address``: resolve it (``auto``), reach its GCS port (``ray.connect_timeout_s``;
    ``ray.init`` alone retries an unreachable address for ever), read the versions the
    cluster was started with and compare them with this process's (:func:`version_mismatch`),
    then ``ray.init``."""
    try:
        import ray
    except ImportError as exc:
        raise RelayError("launcher: ray needs Ray: pip install 'ray>=2.40'") from exc
    if ray.is_initialized():
        return
    address = None
    if cfg.address != "local":
        address = resolve_address(cfg.address)
    if address not in (None, "auto"):
        wait_for_port(address, cfg.address, cfg.connect_timeout_s)
        metadata = cluster_metadata(address, cfg.address, cfg.connect_timeout_s)
        problem = version_mismatch(metadata, *driver_versions())
        if problem:
            raise RelayError(f"ray.address={cfg.address!r} ({address}): {problem}")
    if address is None:
        private_ray_token()  # before Ray writes one world-readable
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        what = "start a local Ray cluster" if address is None else f"connect to {address!r}"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RelayError(f"ray.address={cfg.address!r}: could not {what}: {first}") from exc
    private_ray_token()


RAY_TOKEN = Path("~/.ray/auth_token")  # Ray's token-authentication secret (Ray ≥ 2.5x)


def private_ray_token() -> None:
    """Ray's auth token readable by this user only: Ray writes ``~/.ray/auth_token`` with
    the umask (0644: another user holding it had full access to the cluster's object
    store). A local cluster's token is created here first, 0600, as Ray would make it (Ray
    keeps an existing file's mode); an existing one of ours is made 0600; ``~/.ray`` 0700."""
    token = RAY_TOKEN.expanduser()
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "disabled" and not token.exists():
        try:
            from ray._private.authentication.authentication_token_generator import (
                generate_new_authentication_token,
            )
        except ImportError:  # a Ray without token authentication
            return
        token.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(generate_new_authentication_token())
    for path, mode in ((token.parent, 0o700), (token, 0o600)):
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if info.st_uid == os.geteuid() and not stat.S_ISLNK(info.st_mode):
            os.chmod(path, mode)


def resolve_address(address: str) -> str:
    """``host:port`` of ``ray.address`` (``auto``: ``$RAY_ADDRESS``, else the cluster that
    ``ray start`` last recorded on this node, as ``ray.init`` resolves it)."""
    if address == "auto":
        try:  # Ray's own resolution (private: present in Ray 2.40 to 2.60)
            from ray._private.services import canonicalize_bootstrap_address
        except ImportError:
            return address  # ray.init resolves it, unbounded
        found = canonicalize_bootstrap_address("auto")
        if found is None:
            raise RelayError(
                "ray.address='auto': no Ray cluster on this node (RAY_ADDRESS is unset and "
                "no `ray start` is recorded under /tmp/ray); start one with `ray start "
                "--head` or give its head as ray.address=HOST:PORT"
            )
        return found
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RelayError(
            f"ray.address={address!r}: expected 'local', 'auto' or HOST:PORT of a Ray head "
            "(e.g. 10.0.0.1:6379)"
        )
    return address


def wait_for_port(address: str, key_value: str, timeout_s: float) -> None:
    """Until ``address``'s TCP port accepts a connection (a head may be starting); one
    error naming ``ray.address``, what was tried and the last failure after ``timeout_s``."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    tries = 0
    while True:
        tries += 1
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
                return
        except OSError as exc:
            last = exc.strerror or type(exc).__name__
        if time.monotonic() + PROBE_INTERVAL_S > deadline:
            raise RelayError(
                f"ray.address={key_value!r}: no Ray head answers at {address}: {tries} TCP "
                f"connection attempts over {timeout_s:.0f}s (ray.connect_timeout_s) failed, "
                f"last with {last!r}; start the head (`ray start --head --port={port}`) or "
                "fix ray.address"
            )
        time.sleep(PROBE_INTERVAL_S)


def cluster_metadata(address: str, key_value: str, timeout_s: float) -> dict[str, Any]:
    """The versions the cluster at ``address`` was started with, from its GCS (what
    ``ray.init`` checks too, but only after connecting and with a multi-line message)."""
    try:  # private too; without it ray.init still checks, after connecting
        from ray._raylet import GcsClient
    except ImportError:
        return {}
    use_token_if_present()
    try:
        raw = GcsClient(address=address).internal_kv_get(
            CLUSTER_METADATA_KEY, namespace=CLUSTER_NAMESPACE, timeout=timeout_s
        )
    except Exception as exc:  # grpc timeouts and status errors have no common base class
        raise RelayError(
            f"ray.address={key_value!r}: {address} accepts connections but did not answer as "
            f"a Ray GCS within {timeout_s:.0f}s (ray.connect_timeout_s): {exc}; is it a Ray "
            "head's port (`ray start --head --port=...`)?"
        ) from None
    return json.loads(raw) if raw else {}


def use_token_if_present() -> None:
    """Speak token authentication to the cluster when this user holds Ray's token and
    ``RAY_AUTH_MODE`` is unset, as ``ray.init`` does when it connects (Ray ≥ 2.5x: ``ray
    start`` turns token auth on when ``~/.ray/auth_token`` exists; without this the version
    probe was refused as unauthenticated)."""
    try:  # private, as the probe's GcsClient; a Ray without token authentication lacks it
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def driver_versions() -> tuple[str, str, str]:
    """(Ray, Python, relayrl) versions of this process."""
    import ray

    import relayrl

    return ray.__version__, ".".join(map(str, sys.version_info[:3])), relayrl.__version__


def version_mismatch(
    metadata: dict[str, Any], ray_version: str, python_version: str, relayrl_version: str = ""
) -> str | None:
    """What differs between a cluster's recorded versions (``metadata``: ``ray_version``,
    ``python_version``, and ``relayrl_version`` where a node reported it) and this process's,
    as Ray requires (the same Ray; the same Python down to the patch level unless
    ``RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL=minor``); None when they match or the cluster
    recorded nothing."""
    if not metadata:
        return None
    level = os.environ.get("RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL", "patch")
    digits = 2 if level == "minor" else 3
    theirs_py = str(metadata.get("python_version", python_version))
    problems = []
    if str(metadata.get("ray_version", ray_version)) != ray_version:
        problems.append(f"Ray {metadata['ray_version']} there, {ray_version} here")
    if theirs_py.split(".")[:digits] != python_version.split(".")[:digits]:
        problems.append(f"Python {theirs_py} there, {python_version} here")
    theirs_rr = str(metadata.get("relayrl_version", relayrl_version))
    if theirs_rr != relayrl_version:
        problems.append(f"relayrl {theirs_rr} there, {relayrl_version} here")
    if not problems:
        return None
    return (
        "version mismatch between this driver and the Ray cluster: "
        + "; ".join(problems)
        + "; every node and the driver need the same versions (install them into this "
        "environment, or restart the cluster from it)"
    )


class _ProcessHost:
    """The Ray actor owning one child process on its node (a server or a trainer rank)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.new_session = False

    def _launch(
        self,
        argv: list[str],
        env: dict[str, str],
        log: str,
        log_mode: str,
        new_session: bool,
        pass_fds: tuple[int, ...] = (),
    ) -> dict[str, Any]:
        """Start ``argv`` as this actor's child (dying with it), output to ``log``; what
        ``cluster.json`` records of it."""
        import ray

        env = dict(env)
        env[PARENT_ENV] = str(os.getpid())
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        with open(log, log_mode) as out:
            if log_mode == "a":
                out.write(f"\n----- restarted at {time.strftime('%Y-%m-%d %H:%M:%S')} -----\n")
                out.flush()
            self.proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=new_session,
                pass_fds=pass_fds,
            )
        self.new_session = new_session
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "actor_pid": os.getpid(),
            "pid": self.proc.pid,
            "log": log,
            "versions": dict(zip(VERSION_KEYS, driver_versions(), strict=True)),
        }

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def signal(self, sig: int) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(OSError):
            if self.new_session:
                os.killpg(self.proc.pid, sig)
            elif self.proc.poll() is None:
                self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.proc.wait(timeout=timeout)
        return None


class _ServerHost(_ProcessHost):
    """The actor of one rollout server: the local launcher's server command, on this node's
    address; the server dies with the actor (``PARENT_ENV``)."""

    def start(self, spec: Any, index: int, log: str, log_mode: str) -> dict[str, Any]:
        """Bind the server's port here, then start the server on that socket (inherited, as
        the local launcher does: no other process can take the port meanwhile); the actor
        keeps its copy, and the port, for as long as it lives."""
        import ray

        host = ray.util.get_node_ip_address()
        spec = replace(spec, host=host)
        self.sock = reserve_port(host, None if spec.port is None else spec.port + index)
        port = self.sock.getsockname()[1]
        env = dict(os.environ, **spec.environment(index))
        env[LISTEN_FD_ENV] = str(self.sock.fileno())
        info = self._launch(
            spec.command(port), env, log, log_mode, spec.new_session, (self.sock.fileno(),)
        )
        info["server_pid"] = info.pop("pid")
        return {"url": f"http://{host}:{port}", **info}


class RankHost(_ProcessHost):
    """The actor of one trainer rank ≥ 1: the worker entry point the local launcher runs as a
    subprocess (``relayrl.train.distributed.worker_main``), with its rendezvous environment."""

    def start(self, argv: list[str], env: dict[str, str], log: str) -> dict[str, Any]:
        return self._launch(argv, dict(os.environ, **env), log, "w", False)


class RemoteServer:
    """A ``subprocess.Popen``-like handle on a server run by a :class:`_ServerHost` actor:
    what :class:`ServerLauncher` needs (``poll``, ``wait``, ``send_signal``, ``pid``). A dead
    actor reads as a server killed by SIGKILL."""

    def __init__(self, actor: Any, info: dict[str, Any]) -> None:
        self.actor, self.info = actor, info
        self.pid = int(info.get("server_pid") or info["pid"])
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        import ray

        try:
            self.returncode = ray.get(self.actor.poll.remote(), timeout=30)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            self.returncode = -signal.SIGKILL  # the actor (and with it the server) is gone
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("ray server", timeout)
            time.sleep(0.1)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with contextlib.suppress(Exception):
            self.actor.signal.remote(sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@dataclass
class RayServerLauncher(ServerLauncher):
    """The local launcher's interface over Ray actors; see the module docstring."""

    ray_config: RayConfig = field(default_factory=RayConfig)
    _group: Any = None
    _actor_class: Any = None

    def start(self) -> list[str]:
        if self.mode == "thread":
            raise RelayError("launcher: ray runs rollout.server_mode=process servers only")
        connect(self.ray_config)
        try:
            self._group = self._reserve()
            for i in range(self.num_servers):
                self._start_process(i)
            self._write_cluster_file()
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self.urls

    def _bundle(self) -> dict[str, float]:
        c = self.ray_config
        bundle = {"CPU": c.server_cpus, **c.server_resources}
        if c.server_gpus:
            bundle["GPU"] = c.server_gpus
        return bundle

    def _reserve(self) -> Any:
        return reserve(
            ROLE,
            [self._bundle()] * self.num_servers,
            self.ray_config.placement_strategy,
            self.ray_config.placement_timeout_s,
            "lower ray.server_cpus / rollout.num_servers or add nodes",
        )

    def _spawn(self, i: int, log_mode: str) -> tuple[RemoteServer, Path, str]:
        return self._popen(i, log_mode)

    def _popen(self, i: int, log_mode: str) -> tuple[RemoteServer, Path, str]:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self._actor_class is None:
            self._actor_class = ray.remote(max_restarts=0)(_ServerHost)
        c = self.ray_config
        strategy = PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=i)
        actor = self._actor_class.options(
            num_cpus=c.server_cpus,
            num_gpus=c.server_gpus,
            resources=dict(c.server_resources),
            scheduling_strategy=strategy,
            name=None,
        ).remote()
        log = self.log_path(i)
        info = await_start(
            actor,
            actor.start.remote(self.spec_for(i), i, str(log), log_mode),  # its key, not the run's
            f"rollout server {i}",
            self.startup_timeout_s,
            "rollout.startup_timeout_s",
        )
        return RemoteServer(actor, info), log, info["url"]

    def respawn(self, i: int) -> str:
        url = super().respawn(i)  # kill(i) frees the bundle, then a fresh actor in it
        self._write_cluster_file()
        return url

    def kill(self, i: int) -> None:
        import ray

        proc = self._procs[i]
        proc.send_signal(signal.SIGKILL)
        with contextlib.suppress(Exception):
            ray.kill(proc.actor, no_restart=True)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)

    def _signal(self, proc: RemoteServer, sig: int) -> None:
        proc.send_signal(sig)

    def _wait_group_gone(self, pgid: int, deadline: float) -> None:
        return None  # the actor owns its server's process group; killing it ends the group

    def node_of(self, i: int) -> str:
        """``<node id prefix>@<node address>`` (nodes on one host share the address)."""
        if i >= len(self._procs):
            return "?"
        info = self._procs[i].info
        return f"{info['node_id'][:6]}@{info['node_ip']}"

    def describe(self, i: int, what: str, consequence: str = "the run cannot continue") -> str:
        node = self._procs[i].info["node_ip"] if i < len(self._procs) else "?"
        return super().describe(i, f"on Ray node {node} {what}", consequence)

    def stop(self) -> None:
        import ray

        actors = [p.actor for p in self._procs]
        super().stop()
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        if self._group is not None:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(self._group)
            self._group = None

    def _write_cluster_file(self) -> None:
        if self.log_dir is None:
            return
        servers = [{"index": i, **p.info} for i, p in enumerate(self._procs)]
        placement = {"role": ROLE, "bundle": self._bundle(), **self.ray_config.model_dump()}
        update_cluster_file(self.log_dir, placement=placement, servers=servers)


def update_cluster_file(run_dir: Path, **sections: Any) -> None:
    """Set ``sections`` of ``<run>/cluster.json`` (servers, trainer ranks), keeping the others."""
    path = run_dir / "cluster.json"
    found = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**found, **sections}, indent=2))


def reserve(
    role: str, bundles: list[dict[str, float]], strategy: str, timeout_s: float, hint: str
) -> Any:
    """A ready placement group of ``bundles`` for ``role``; one error after ``timeout_s``
    naming the role, the bundles, what the cluster has and ``hint`` (what to lower)."""
    import ray
    from ray.util.placement_group import placement_group

    group = placement_group(bundles, strategy=strategy)
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(group)
        raise RelayError(
            f"Ray could not place the {role}: {len(bundles)} × {bundles[0]} ({strategy}) "
            f"within {timeout_s:.0f}s (ray.placement_timeout_s); the cluster has "
            f"{ray.cluster_resources()} in all, {ray.available_resources()} free; {hint}"
        ) from None
    return group


def await_start(actor: Any, ref: Any, what: str, timeout_s: float, key: str) -> dict[str, Any]:
    """The info an actor's ``start`` returned, checked for the driver's versions; one error
    naming ``what`` when it did not start within ``timeout_s`` (config ``key``) or failed."""
    import ray

    try:
        info = ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.kill(actor)
        raise RelayError(
            f"{what}: its Ray actor did not start within {timeout_s:.0f}s ({key})"
        ) from None
    except ray.exceptions.RayError as exc:  # e.g. relayrl missing on that node
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        raise RelayError(
            f"{what}: its Ray actor failed to start: {lines[-1] if lines else exc}"
        ) from None
    problem = version_mismatch(info["versions"], *driver_versions())
    if problem:
        ray.kill(actor)
        raise RelayError(f"{what} on Ray node {info['node_ip']}: {problem}")
    return info
