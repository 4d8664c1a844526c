"""The authenticated control plane (docs/security.md), as an attacker on the same machine
would try it: a launched built-in server refuses weight updates, pauses and group joins
without the run's key (also on loopback), the key never appears in a command line, a server
bound to a node's own address (``launcher=ray``) starts with the key, ``rollout.api_key`` is
never written to the run directory, and the transfer group's TCPStore listens on the group's
interface only and cannot be joined without the run's secret."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import yaml

from relayrl.config.loader import load_config, save_config
from relayrl.engine.transfer import TransferGroup
from relayrl.errors import RelayError
from relayrl.launch.backends import make_backend
from relayrl.launch.servers import free_port, healthy
from relayrl.runkey import API_KEY_ENV, read_key_file, run_key, server_key, write_key_file


def builtin_config(model_dir: Path, *overrides: str):
    return load_config(None, [f"model.path={model_dir}", "model.max_context=64", *overrides])


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_a_launched_server_refuses_the_control_plane_without_the_run_key(tiny_model_dir, tmp_path):
    backend = make_backend(builtin_config(tiny_model_dir), tiny_model_dir)
    with backend.launcher(tmp_path) as launcher:
        url, pid = launcher.urls[0], launcher.pids[0]
        key = backend.api_key
        assert key and len(key) >= 40
        assert key not in cmdline(pid)  # never in argv: other users read /proc/*/cmdline
        attacks = [
            ("/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": 7}),
            ("/pause_generation", {"mode": "abort"}),
            ("/init_weights_update_group", {
                "master_address": "127.0.0.1", "master_port": 9, "rank_offset": 1,
                "world_size": 2, "group_name": "evil"}),
            ("/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}),
        ]  # fmt: skip
        for path, body in attacks:
            for headers in ({}, {"Authorization": "Bearer " + key[:-1]}):
                r = httpx.post(url + path, json=body, headers=headers, timeout=30)
                assert r.status_code == 401, (path, r.text)
        assert healthy(url)  # /health stays open (liveness probes)

        async def as_the_run() -> tuple[int, int]:
            async with backend.client(launcher.urls) as client:
                out = await client.generate([5, 6], {"max_new_tokens": 2, "ignore_eos": True})
                (info,) = await client.model_info()
                return len(out.output_ids), info["weight_version"]

        assert asyncio.run(as_the_run()) == (2, 0)  # the run's own client sends the key


def test_a_server_on_a_node_address_starts_with_the_launcher_key(tiny_model_dir, tmp_path):
    """What a Ray actor runs (``_ServerHost.start``): the spec bound to the node's own
    address; without a key it refused to start, now the launcher's key lets it."""
    address = routable_address()
    if address is None:
        pytest.skip("no non-loopback IPv4 address on this machine")
    backend = make_backend(builtin_config(tiny_model_dir, "launcher=ray"), tiny_model_dir)
    spec, port = replace(backend.launched_spec(), host=address), free_port()
    env = dict(os.environ, **spec.environment(0))
    with open(tmp_path / "server.log", "w") as log:
        proc = subprocess.Popen(spec.command(port), stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://{address}:{port}"
        deadline = time.monotonic() + 120
        while not healthy(url):
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.2)
        body = {"model_path": str(tmp_path), "weight_version": 7}
        assert httpx.post(url + "/update_weights_from_disk", json=body).status_code == 401
        auth = {"Authorization": f"Bearer {spec.api_key}"}
        assert httpx.get(url + "/get_model_info", headers=auth).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def routable_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: picks the outgoing interface
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_api_key_of_external_servers_comes_from_config_or_env_and_is_never_saved(
    tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    urls = "rollout.server_urls=[http://127.0.0.1:9]"
    config = builtin_config(tiny_model_dir, urls, "rollout.api_key=from-config")
    assert make_backend(config, tiny_model_dir).api_key == "from-config"
    save_config(config, tmp_path / "config.yaml")
    saved = (tmp_path / "config.yaml").read_text()
    assert "from-config" not in saved and "api_key" not in yaml.safe_load(saved)["rollout"]

    monkeypatch.setenv(API_KEY_ENV, "from-env")
    plain = builtin_config(tiny_model_dir, urls)
    backend = make_backend(plain, tiny_model_dir)
    assert backend.api_key == "from-env"
    assert backend.client(["http://127.0.0.1:9"]).api_key == "from-env"


def test_a_key_per_server_from_a_fresh_run_key_and_another_for_the_teacher(
    tiny_model_dir, tmp_path
):
    """What docs/security.md ("A key per server") says each launched server is given: a key
    of its own in its environment (never the run key), derived from a run key fresh for
    each command; the launched teacher's key derives from a key of its own.
    (tests/launch/test_server_keys.py: the keys at work, restarts included.)"""
    from relayrl.launch.teacher import teacher_launcher

    config = builtin_config(tiny_model_dir, f"distill.teacher={tiny_model_dir}")
    backend = make_backend(config, tiny_model_dir)
    launcher = backend.launcher(tmp_path)  # not started: what it would start
    given = [launcher.spec_for(i).environment(i)[API_KEY_ENV] for i in range(3)]
    assert given == [server_key(backend.api_key, i, 0) for i in range(3)]
    assert len(set(given)) == 3 and backend.api_key not in given
    teacher = teacher_launcher(config, tmp_path)
    others = {
        make_backend(config, tiny_model_dir).launched_spec().api_key,  # the next command's
        teacher.spec.api_key,
    }
    assert len(backend.api_key) == 43 and len(others) == 2 and backend.api_key not in others
    assert teacher.key_of(0) == server_key(teacher.spec.api_key, 0, 0) not in given


def test_key_files_must_be_private_and_the_run_key_is_created_0600(tmp_path):
    key = run_key(tmp_path)
    assert (tmp_path / "run.key").stat().st_mode & 0o777 == 0o600
    assert run_key(tmp_path) == key
    loose = tmp_path / "loose.key"
    write_key_file(loose, "k")
    loose.chmod(0o644)
    with pytest.raises(RelayError, match="accessible to other users.*chmod 600"):
        read_key_file(loose, "--api-key-file")


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a TCP socket listening on ``port`` (from /proc/net/tcp{,6})."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


def test_the_transfer_store_listens_on_the_group_interface_and_needs_the_secret():
    port = free_port()
    host: dict[str, TransferGroup] = {}

    def rank0() -> None:
        host["g"] = TransferGroup.join("127.0.0.1", port, 0, 2, "g1", 3.0, "run-secret")

    async def scenario() -> None:
        task = asyncio.ensure_future(asyncio.to_thread(rank0))
        await asyncio.sleep(0.5)
        assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1 only, not *:PORT
        with pytest.raises(RelayError, match="could not join"):  # wrong secret: no group
            await asyncio.to_thread(TransferGroup.join, "127.0.0.1", port, 1, 2, "g1", 2.0, "guess")
        with pytest.raises(RelayError):
            await task  # nobody with the secret joined in time

    asyncio.run(scenario())

    port = free_port()

    async def with_the_secret() -> None:
        a = asyncio.to_thread(TransferGroup.join, "127.0.0.1", port, 0, 2, "g2", 20.0, "s")
        b = asyncio.to_thread(TransferGroup.join, "127.0.0.1", port, 1, 2, "g2", 20.0, "s")
        groups = await asyncio.gather(a, b)
        for g in groups:
            g.close()

    asyncio.run(with_the_secret())


def test_an_external_server_refusing_the_key_is_one_error_naming_the_setting(
    tiny_model_dir, monkeypatch
):
    from relayrl.engine.engine import Engine
    from relayrl.engine.server import ServerThread, create_app

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with Engine.from_pretrained(str(tiny_model_dir)) as engine:
        server = ServerThread(create_app(engine, "theirs")).start()
        try:
            for extra in ([], ["rollout.api_key=wrong"], ["rollout.api_key=theirs"]):
                urls = f"rollout.server_urls=[{server.url}]"
                backend = make_backend(builtin_config(tiny_model_dir, urls, *extra), tiny_model_dir)

                async def check(backend=backend) -> None:
                    async with backend.client([server.url]) as client:
                        await backend.check_servers(client)

                if extra == ["rollout.api_key=theirs"]:
                    asyncio.run(check())
                    continue
                sent = "the key it was sent" if extra else "a request without a key"
                with pytest.raises(RelayError, match=f"refused {sent}.*rollout.api_key"):
                    asyncio.run(check())
        finally:
            server.stop()
